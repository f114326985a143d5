"""The hooks' lean path (issue 49): small tensors kept by the C library or its Python twin with
the same counts, no global module hook, parameters and buffers still never moved, and
offloadd's ranges in the user's profiler."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from offloadd import Offloader
from tests._support.helpers import assert_bitwise_equal

ENGINE_PARAMS = ("native-threads",)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Sigmoid()
    )


def _steps(off: Offloader | None, steps: int = 3) -> tuple[list[list[torch.Tensor]], list[int]]:
    model = _model()
    x = torch.randn(8, 32)
    grads: list[list[torch.Tensor]] = []
    peaks: list[int] = []
    for _ in range(steps):
        if off is None:
            loss = model(x).sum()
        else:
            with off:
                loss = model(x).sum()
            peaks.append(off.stats().peak_resident_bytes)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        model.zero_grad()
    return grads, peaks


def test_kept_tensors_exact_and_counted_alike(tally_kind: str, disk_dir: Path) -> None:
    """Both tallies: gradients bitwise plain's, and the same counts and peaks (a step's
    saved tensors are all below min_bytes: every one goes through the tally)."""
    want, _ = _steps(None)
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)])
    got, peaks = _steps(off)
    st = off.stats()
    off.close()
    assert_bitwise_equal(want, got)
    assert st.offloaded_bytes == 0 and st.saved_tensors > 0
    assert st.kept_bytes == st.saved_bytes > 0
    assert st.resident_bytes == 0  # every graph ran its backward: all released
    expected = (8 * 32 + 8 * 64 * 4 + 2 * 8 + 8 * 64) * 4  # inputs, outputs, LN's mean/rstd
    assert peaks[0] >= expected // 2 and len(set(peaks)) == 1, peaks


@pytest.mark.parametrize("min_bytes", [None, 0], ids=["small", "shared"])
def test_kept_tensor_changed_in_place_raises_torchs_error(
    tally_kind: str, min_bytes: int | None
) -> None:
    off = Offloader(tier="keep", **({} if min_bytes is None else {"min_bytes": min_bytes}))
    x = torch.randn(16, requires_grad=True)
    with off:
        y = x.sin()
        z = y.sin()  # saves y
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    off.close()


@pytest.mark.parametrize("min_bytes", [None, 0], ids=["small", "shared"])
def test_a_graph_dropped_unrun_frees_what_it_held(tally_kind: str, min_bytes: int | None) -> None:
    """An op that saves its own output (exp): the Held detaches it, so a graph dropped without
    backward leaves no cycle and its bytes go (see [no cycle through the graph])."""
    off = Offloader(tier="keep", **({} if min_bytes is None else {"min_bytes": min_bytes}))
    x = torch.randn(256, requires_grad=True)
    with off:
        loss = x.exp().exp().sum()
    assert off.stats().resident_bytes > 0
    del loss
    assert off.stats().resident_bytes == 0
    off.close()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("scale", torch.rand(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale  # mul saves the buffer


def test_tier_keep_counts_each_storage_once(tally_kind: str) -> None:
    """Tier keep holds every tensor where it is, with no block: a storage saved three times
    (twice as itself, once transposed) counts its bytes once, as held from its first save to
    its last release; a parameter and a module's buffer count none (see [the tally])."""
    kib16 = 64 * 64 * 4
    off = Offloader(tier="keep", min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        loss = (x.sin() + x.cos() + x.t().sin().t() + x.exp()).sum()  # exp saves its output
    st = off.stats()
    assert st.saved_tensors == 4 and st.saved_bytes == 4 * kib16
    assert st.deduplicated_bytes == 2 * kib16 and st.kept_bytes == 2 * kib16
    assert st.resident_bytes == 2 * kib16  # x, and exp's output
    loss.backward()
    assert off.stats().resident_bytes == 0

    model = _Scaled()
    for step in range(2):  # the buffer: learned in the first step's slow path, then in C
        with off:
            y = model(torch.randn(64, 64, requires_grad=True))
        # lin saves the input and its weight (a parameter), mul the buffer only
        assert off.stats().resident_bytes == kib16, step
        y.sum().backward()
        assert off.stats().resident_bytes == 0
    off.close()


def test_no_global_module_hook_and_no_compile_warning(disk_dir: Path) -> None:
    """No global module hook in an Offloader's scope (it cost ~1 us on every module call), so
    torch.compile(model) does not warn that global hooks fire an extra time."""
    model = _model()
    run = torch.compile(model, backend="aot_eager")
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with off:
                assert not torch.nn.modules.module._has_any_global_hook()
                loss = run(torch.randn(8, 32)).sum()
            loss.backward()
    off.close()


def test_a_buffer_is_never_moved_after_the_model_moves(disk_dir: Path) -> None:
    """Buffers are learned from the models on the stack (Note [parameters learned]), and again
    in a later step once the model's storages changed (``.double()``)."""

    model = _Scaled()
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=1024)
    for dtype in (torch.float32, torch.float64):
        model.to(dtype)
        before = off.stats().offloaded_bytes
        with off:
            y = model(torch.randn(64, 64, dtype=dtype, requires_grad=True))
        y.sum().backward()
        moved = off.stats().offloaded_bytes - before
        # the input (which lin saves), never the buffer
        assert moved == 64 * 64 * dtype.itemsize, (dtype, moved)
    off.close()


def test_parameters_learned_again_only_once_moved(walks: list[int]) -> None:
    """A step that saves a tensor that does not require grad (LayerNorm's statistics) walks
    the model only when its parameters moved, or every RELEARN_EVERY steps (Note [parameters
    learned])."""
    from offloadd.runtime import dedup

    model = _Scaled()
    norm = nn.LayerNorm(64)
    off = Offloader(tier="keep", min_bytes=0)

    def step(dtype: torch.dtype) -> None:
        with off:
            y = norm(model(torch.randn(64, 64, dtype=dtype, requires_grad=True)))
        # lin's input, norm's input, its mean and rstd; never the buffer mul saves
        assert off.stats().resident_bytes == (2 * 64 * 64 + 2 * 64) * dtype.itemsize
        y.sum().backward()

    for _ in range(5):
        step(torch.float32)
    # step 1 finds model (its buffer); norm, a second root, is found in step 2: a step that
    # learned once does not look for models again on tier keep's C path
    assert walks == [1, 2], walks
    model.double()
    norm.double()
    for _ in range(3):
        step(torch.float64)
    assert walks == [1, 2, 6], walks
    for _ in range(dedup.RELEARN_EVERY):
        step(torch.float64)
    assert walks == [1, 2, 6, 6 + dedup.RELEARN_EVERY], walks
    off.close()


def test_ranges_in_the_users_profiler(disk_dir: Path) -> None:
    model = _model()
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with off:
            loss = model(torch.randn(8, 32)).sum()
        loss.backward()
    off.close()
    names = {e.name for e in prof.events()}
    for want in ("offloadd::pack", "offloadd::capture", "offloadd::unpack", "offloadd::read"):
        assert want in names, sorted(n for n in names if n.startswith("offloadd"))


def test_no_range_without_a_profiler() -> None:
    from offloadd.trace import span

    assert isinstance(span("offloadd::pack"), type(span("offloadd::unpack")))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert type(span("offloadd::pack")).__name__ == "record_function"
