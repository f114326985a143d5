"""What a lossy codec must never do, whatever the input: turn finite gradients into NaN (a mask's
-inf, a mask of ``finfo.min``, an activation that legitimately holds inf or NaN).

Gradients are compared with plain PyTorch: finite exactly where plain PyTorch's are, and within
the documented error elsewhere (docs/benchmarks/codec_error_*: the sdpa probe measured int8
0.8 %, fp8-e4m3 2.9 %, fp8-e5m2 5.3 %, int4 12 %, int2 58 % relative L2; TOLERANCE is about
twice that, as in tests/codec/test_codec.py).
"""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import offloadd
from offloadd import Offloader
from offloadd.codec import Codec, Scheme, encode
from offloadd.runtime.dedup import StorageIndex
from offloadd.runtime.identity import Facts

# Tiny tensors: one intra-op thread is fastest, and immune to a busy machine.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CODECS = ["int8", "fp8-e4m3", "fp8-e5m2", "int4", "int2"]
TOLERANCE = {"int8": 0.02, "fp8-e4m3": 0.08, "fp8-e5m2": 0.15, "int4": 0.3, "int2": 1.0}


def coded_offloader(codec: str) -> Offloader:
    """Codes kept in memory (the tiers move them losslessly: tests/codec/test_codec.py), any size."""
    return Offloader(tier="keep", min_bytes=1, codec={"name": codec, "min_bytes": 1})


def gradients(
    fn: Callable[..., torch.Tensor],
    inputs: list[torch.Tensor],
    off: Offloader | None,
    module: nn.Module | None = None,
) -> list[torch.Tensor]:
    """The gradients of ``fn(*inputs)`` for a fixed random cotangent, for the inputs and
    ``module``'s parameters, under ``off`` or plainly."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    params = list(module.parameters()) if module is not None else []
    for p in params:
        p.grad = None
    with off if off is not None else contextlib.nullcontext():
        y = fn(*leaves)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
    out = [x.grad for x in leaves] + [p.grad for p in params]
    assert all(g is not None for g in out)
    return [g for g in out if g is not None]


# -- the cases: masks of every kind, and an activation that holds inf and NaN -------------------

B, H, L, D = 2, 4, 32, 16
_UPPER = torch.ones(L, L).triu(1).bool()


def _mask(kind: str) -> torch.Tensor:
    if kind == "bool-mask":
        return ~_UPPER  # sdpa converts it to a new float tensor of 0 and -inf, and saves that
    if kind == "inf-mask":
        return torch.zeros(L, L).masked_fill(_UPPER, -torch.inf)
    return torch.zeros(L, L).masked_fill(_UPPER, torch.finfo(torch.float32).min)  # HF's masks


def _case(kind: str) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor], nn.Module | None]:
    g = torch.Generator().manual_seed(0)
    if kind.startswith("inf-input"):  # float16: the torch ops encode it, not the C kernels
        dtype = torch.float16 if kind.endswith("f16") else torch.float32
        lin = nn.Linear(64, 64).to(dtype)
        x = torch.randn(4, 32, 64, generator=g).to(dtype)
        x[1, 3, 5], x[2, 7, 9] = torch.inf, torch.nan  # columns 5 and 9 of grad_weight only
        return lin, [x], lin
    mask = _mask(kind)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attention, [torch.randn(B, H, L, D, generator=g) for _ in range(3)], None


KINDS = ["bool-mask", "inf-mask", "finfo-min-mask", "inf-input", "inf-input-f16"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("codec", CODECS)
def test_gradients_stay_finite_where_plain_ones_are(codec: str, kind: str) -> None:
    """A bool mask becomes a saved float tensor of -inf, which a group's range turned into NaN:
    q, k and v's gradients were all NaN. A tensor holding a non-finite value is saved exactly,
    and so is whatever attention saves of the mask's shape; v and the output are still coded.
    (A float mask passed as it is was kept exact by its address before: the same gradients.)"""
    torch.manual_seed(0)
    fn, inputs, module = _case(kind)
    plain = gradients(fn, inputs, None, module)
    off = coded_offloader(codec)
    try:
        got = gradients(fn, inputs, off, module)
        coded = off.stats().coded_tensors
    finally:
        off.close()
    names = ["input", "weight", "bias"] if module is not None else ["q", "k", "v"]
    for name, a, b in zip(names, got, plain, strict=True):
        bad = int((~a.isfinite() & b.isfinite()).sum())
        assert bad == 0, f"{codec} {kind}: {name}.grad has {bad} non-finite where plain has none"
        assert torch.equal(a.isfinite(), b.isfinite()), f"{name}: non-finite elsewhere"
    kept = [
        (a[b.isfinite()].float(), b[b.isfinite()].float()) for a, b in zip(got, plain, strict=True)
    ]
    diff = torch.cat([a - b for a, b in kept])
    err = float(
        torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(torch.cat([b for _, b in kept]))
    )
    assert err <= TOLERANCE[codec], (codec, kind, err)
    if module is not None:  # the input holds inf and NaN: saved exactly, and nothing else is coded
        assert coded == 0
        for a, b in zip(got, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        assert coded == 2  # v and the output


@pytest.mark.parametrize("mask_shape", [(L, L), (B, 1, L, L)])
def test_what_attention_saves_of_the_mask_shape_stays_exact(
    mask_shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel may save a tensor it derives from the mask (the float copy of a bool mask; a
    padded copy, on CUDA): the mask's shape at a new address. Of ``finfo.min`` it is finite, so
    only its shape tells it apart: a copy of the mask is never coded, v is."""
    off = coded_offloader("int8")
    codec = off.runtime.codec
    assert isinstance(codec, Codec)
    wants = codec.wants
    copies: list[bool] = []

    def spy(t: torch.Tensor) -> bool:
        if t.shape == mask_shape:
            copies.append(wants(t.clone()))  # what a derived mask looks like to the codec
        return wants(t)

    monkeypatch.setattr(codec, "wants", spy)
    mask = _mask("finfo-min-mask").expand(mask_shape).contiguous()
    qkv = [torch.randn(B, H, L, D) for _ in range(3)]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    try:
        gradients(attention, qkv, off)
        coded = off.stats().coded_tensors
    finally:
        off.close()
    assert copies == [False], copies
    assert coded == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("codec", [*CODECS, "int8-affine"])
def test_encode_says_when_a_range_is_not_finite(codec: str, dtype: torch.dtype) -> None:
    """Both paths (the C kernels and the torch ops) flag, from the ranges they compute anyway,
    a group holding inf, -inf or NaN, and one past the edge where a decoded value could overflow
    (int8 used to decode float32's finfo.min to -inf); 2**126 itself is coded."""
    s = Scheme(codec.removesuffix("-affine"), symmetric=not codec.endswith("-affine"))
    big = [torch.finfo(torch.float32).min, 2.0**127] if dtype != torch.float16 else []
    for native in (True, False):
        x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
        if dtype != torch.float16:
            x[5, 9] = 2.0**126
        assert encode(x, s, 64, native=native).finite
        for value in [torch.inf, -torch.inf, torch.nan, *big]:
            y = x.clone()
            y[3, 7] = value
            enc = encode(y, s, 64, native=native)
            assert not enc.finite, (native, value)
            assert bool(enc.params[3].isnan().all()) and not bool(enc.params[[0, 5]].isnan().any())


# -- memory: flat over a long run ---------------------------------------------------------------


def test_the_codec_s_memory_stays_flat_over_hundreds_of_steps() -> None:
    """The exact-save table was keyed on (device, storage, version) and noted the views of
    weights that linear saves: each optimizer step bumps a weight's version, so every weight
    added an entry per step, never pruned (its storage lives), and begin_step's prune walked
    them all. Now one entry per live storage, at its latest version, and no parameter: the
    tables and offloadd's Python memory are the same after step 20 and after step 220."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    off = coded_offloader("int8")
    codec = off.runtime.codec
    assert isinstance(codec, Codec)
    x = torch.randn(8, 16)
    own = [tracemalloc.Filter(True, str(Path(offloadd.__file__).parent / "*"))]
    traced: dict[int, int] = {}
    tables: dict[int, tuple[int, int]] = {}
    try:
        for step in range(221):
            if step == 10:  # after the first steps' imports and caches (slow to trace)
                tracemalloc.start()
            with off:
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step in (20, 220):
                gc.collect()
                snapshot = tracemalloc.take_snapshot().filter_traces(own)
                traced[step] = sum(s.size for s in snapshot.statistics("filename"))
                tables[step] = len(codec._exact), len(codec._saved)
    finally:
        tracemalloc.stop()
        off.close()
    assert off.stats().coded_tensors > 0
    grown = traced[220] - traced[20]
    assert grown < 4096, f"offloadd's memory grew {grown} bytes; (_exact, _saved): {tables}"
    assert tables[220] == tables[20] and max(tables[220]) <= 8, tables


def _traced_growth(codec: str, first: int, last: int) -> tuple[int, list[str]]:
    """Bytes that offloadd's lines hold at step ``last`` beyond step ``first``, and the lines
    that hold most, each measured after a full collection (which also empties CPython's free
    lists: what they keep is traced to the line that first allocated it, wherever it is reused)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    cfg: dict[str, Any] = {"codec": {"name": codec, "min_bytes": 1}} if codec != "none" else {}
    off = Offloader(tier="keep", min_bytes=1, **cfg)
    x = torch.randn(8, 16)
    own = [tracemalloc.Filter(True, str(Path(offloadd.__file__).parent / "*"))]
    snaps: dict[int, tracemalloc.Snapshot] = {}
    try:
        for step in range(last + 1):
            if step == 10:  # after the first steps' imports and caches (slow to trace)
                tracemalloc.start()
            with off:
                loss = model(x).square().mean()
            loss.backward()
            del loss
            if step in (first, last):
                gc.collect()
                snaps[step] = tracemalloc.take_snapshot().filter_traces(own)
    finally:
        tracemalloc.stop()
        off.close()
    assert codec == "none" or off.stats().coded_tensors > 0
    diff = snaps[last].compare_to(snaps[first], "lineno")
    return sum(d.size_diff for d in diff), [str(d) for d in diff[:3]]


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_python_memory_stays_flat_from_step_to_step(codec: str) -> None:
    """Noting the modules called in the scope read each parameter's attributes through the
    codec's torch function mode: each read a call of it from C++, with tuples and the attribute's
    name made afresh, which CPython keeps in its free lists and its type attribute cache, traced
    to the lines that read (tens of bytes a step, for thousands of steps, until they fill). Read
    with torch functions off, nothing is left behind, with or without a codec."""
    grown, top = _traced_growth(codec, 40, 240)
    assert grown < 1024, (grown, top)


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_python_memory_stays_flat_over_two_thousand_steps(codec: str) -> None:
    """The same from step 200 to step 2000."""
    grown, top = _traced_growth(codec, 200, 2000)
    assert grown < 4096, (grown, top)


class _Counting(TorchFunctionMode):
    """A torch function mode that records the names of the functions it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.seen.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_noting_a_module_calls_no_torch_function_mode() -> None:
    """The module hook runs inside the scope, under the codec's mode (or a user's): the storages
    of a module's parameters and buffers are read without calling it, and still noted."""
    module = nn.BatchNorm1d(4)
    index = StorageIndex(dedup=True)
    with _Counting() as mode:
        index.note_module(module)
    assert mode.seen == []
    for t in (module.weight, module.running_mean):
        assert index.backs_parameter(t.detach(), Facts(t.detach()))
