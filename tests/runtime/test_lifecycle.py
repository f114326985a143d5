"""The known traps of saved-tensor hooks: in-place after save, dedup, unpack order, threads,
lifecycles (see [never a silently wrong gradient] and [capture after the op] in offloadd/runtime/)."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offloadd import Offloader
from offloadd.io.buffers import SlotPool, round_up
from tests._support.helpers import (
    MakeOffloader,
    SavePayload,
    StagedEngine,
    assert_bitwise_equal,
    train,
)

pytestmark = pytest.mark.usefixtures("backend")

N = 512  # 512 x 512 float32 = 1 MiB


@pytest.mark.parametrize(
    ("tier", "numel"),
    [("ssd", 10), ("keep", N * N)],  # kept because small; kept because of the tier
    ids=["small-kept", "keep-tier-large"],
)
def test_inplace_after_save_of_kept_tensor_raises(
    make_offloader: MakeOffloader, tier: str, numel: int, disk_dir: Path
) -> None:
    off = make_offloader(disk_dir, tier=tier, min_bytes=4096)
    x = torch.randn(numel, requires_grad=True)
    with off:
        y = x * 2
        z = y.sin()
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    off.close()


def test_inplace_before_capture_raises(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """Changed in place before its capture (here: before the scope ended): PyTorch's error, as
    autograd raises without hooks (see [capture after the op])."""
    x = torch.randn(N, N, requires_grad=True)
    off = make_offloader(disk_dir)
    with off:
        y = x * 2
        z = y.sin()
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    off.close()


def test_inplace_after_capture_raises_too(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """Changed in place after its capture: the copy is intact, but autograd without hooks would
    raise, and so does offloadd (the version handle, see capture.py)."""
    x = torch.randn(N, N, requires_grad=True)
    off = make_offloader(disk_dir)
    with off:
        y = x * 2
        z = y.sin()  # saves y: pending
        w = z.exp()  # saves its result: a later node, so y is captured now
        assert off.stats().offloaded_bytes >= N * N * 4
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        w.sum().backward()
    off.close()


def test_views_of_one_storage_are_written_once(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    x = torch.randn(N, N, requires_grad=True)

    def f() -> torch.Tensor:
        y = x * 1.5  # one 1 MiB storage, saved through four different views below
        a = y.sin()  # saves y
        b = y.t().cos()  # saves y.t()
        c = y.unsqueeze(0).expand(3, N, N).tanh()  # tanh saves its (stride-0) output: new storage
        d = (y.unsqueeze(0).expand(2, N, N) * 2.0).exp()  # expand itself is saved by mul? no
        e = torch.mul(y[1:], y[1:].t().t())  # saves two offset views of y
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum()

    expected = torch.autograd.grad(f(), x)[0]
    for dedup in (True, False):
        off = make_offloader(disk_dir, dedup=dedup)
        with off:
            loss = f()
        st = off.stats()
        (g,) = torch.autograd.grad(loss, x)
        assert torch.equal(g, expected)
        y_bytes = N * N * 4
        if dedup:
            assert st.deduplicated_bytes >= 3 * (N - 1) * N * 4  # y.t(), y[1:] twice
            # y's storage is moved once, c's and d's outputs once each.
            assert st.offloaded_bytes == y_bytes + 3 * y_bytes + 2 * y_bytes
        else:
            assert st.deduplicated_bytes == 0
            assert st.offloaded_bytes > 6 * y_bytes
        assert st.bytes_written <= round_up(st.offloaded_bytes) + 64 * 4096
        off.close()


def test_stride0_and_offsets_restored_exactly(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    base = torch.arange(3 * 4096, dtype=torch.float64)
    cases = [
        base,
        base[5:],  # storage offset
        base.view(3, 4096).t(),  # transpose
        base[:4096].expand(3, 4096),  # stride 0
        base.view(3, 4096)[:, ::2],  # strided
        base.view(torch.int32),  # other dtype on the same bytes
    ]
    off = make_offloader(disk_dir, min_bytes=1)
    SavePayload.seen.clear()
    x = torch.ones(1, requires_grad=True)
    with off:
        outs = [SavePayload.apply(x, c) for c in cases]
    torch.autograd.backward(outs, [torch.ones(1)] * len(outs))
    assert len(SavePayload.seen) == len(cases)
    for got, want in zip(reversed(SavePayload.seen), cases, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    off.close()


def test_restored_views_keep_stride_and_offset(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    seen: list[tuple[object, ...]] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, t):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(t)
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            (t,) = ctx.saved_tensors
            seen.append((t.shape, t.stride(), t.storage_offset(), t.dtype))
            return g, None

    base = torch.randn(64, 4096)
    view = base[3:, 7:].t()
    off = make_offloader(disk_dir, min_bytes=1)
    x = torch.ones(1, requires_grad=True)
    with off:
        y = Probe.apply(x, view)
    y.sum().backward()
    assert seen == [(view.shape, view.stride(), view.storage_offset(), view.dtype)]
    off.close()


def test_retain_graph_twice_and_repeated_saved_tensors(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    def run(off: object) -> torch.Tensor:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.Tanh())
        x = torch.randn(512, 256)
        ctx = (
            off
            if off is not None
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with ctx:  # type: ignore[attr-defined]
            loss = m(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    expected = run(None)
    off = make_offloader(disk_dir)
    got = run(off)
    assert torch.equal(got, expected)
    off.synchronize()
    st = off.stats()
    assert st.resident_bytes == 0 and st.disk_bytes == 0
    off.close()


def test_backward_on_another_thread(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    make = lambda: nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 4))  # noqa: E731
    inp = lambda g: torch.randn(512, 256, generator=g)  # noqa: E731
    expected = train(make, inp, None, steps=1)
    off = make_offloader(disk_dir)
    torch.manual_seed(0)
    model = make()
    x = inp(torch.Generator().manual_seed(1))
    with off:
        loss = model(x).float().square().mean()
    errors: list[BaseException] = []

    def bw() -> None:
        try:
            loss.backward()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=bw)
    t.start()
    t.join()
    assert not errors
    got = [[loss.detach(), torch.get_rng_state()] + [p.grad for p in model.parameters()]]
    assert_bitwise_equal(expected, got)
    off.close()


@pytest.mark.parametrize("order", ["fifo", "lifo", "interleaved"])
def test_several_forwards_before_backward(
    make_offloader: MakeOffloader, order: str, disk_dir: Path
) -> None:
    def run(off: object) -> torch.Tensor:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(128, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 128))
        xs = [torch.randn(256, 128) for _ in range(4)]
        losses = []
        for x in xs[:3]:
            if off is None:
                losses.append(m(x).square().mean())
            else:
                with off:  # type: ignore[attr-defined]
                    losses.append(m(x).square().mean())
        if order == "fifo":
            for loss in losses:
                loss.backward()
        elif order == "lifo":
            for loss in reversed(losses):
                loss.backward()
        else:  # pipeline-like: one more forward between backwards
            losses[0].backward()
            if off is None:
                losses.append(m(xs[3]).square().mean())
            else:
                with off:  # type: ignore[attr-defined]
                    losses.append(m(xs[3]).square().mean())
            for loss in losses[1:]:
                loss.backward()
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    expected = run(None)
    off = make_offloader(disk_dir)
    assert torch.equal(run(off), expected)
    off.synchronize()
    st = off.stats()
    assert st.resident_bytes == 0 and st.disk_bytes == 0
    off.close()


def test_dropped_graph_and_exception_leak_nothing(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    off = make_offloader(disk_dir)
    m = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    x = torch.randn(512, 256)
    with off:
        loss = m(x).sum()
    assert off.stats().disk_bytes + off.stats().resident_bytes > 0
    del loss  # graph dropped without backward
    gc.collect()
    off.synchronize()
    st = off.stats()
    assert st.resident_bytes == 0 and st.disk_bytes == 0

    class Boom(Exception):
        pass

    with pytest.raises(Boom), off:
        h = m(x)
        h = m[1](m[0](x)) * 2
        raise Boom
    del h
    gc.collect()
    off.synchronize()
    st = off.stats()
    assert st.resident_bytes == 0 and st.disk_bytes == 0
    with off:  # still usable
        loss = m(x).sum()
    loss.backward()
    off.close()


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_inside_block(
    make_offloader: MakeOffloader, reentrant: bool, disk_dir: Path
) -> None:
    def run(off: object) -> torch.Tensor:
        torch.manual_seed(0)
        blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Dropout(0.1), nn.Linear(512, 256))
            for _ in range(3)
        )
        x = torch.randn(256, 256, requires_grad=True)

        def fwd() -> torch.Tensor:
            h = x
            for i, b in enumerate(blocks):
                h = checkpoint(b, h, use_reentrant=reentrant) if i != 1 else b(h)
            return h.square().mean()

        if off is None:
            loss = fwd()
        else:
            with off:  # type: ignore[attr-defined]
                loss = fwd()
        loss.backward()
        return torch.cat([x.grad.flatten()] + [p.grad.flatten() for p in blocks.parameters()])

    expected = run(None)
    off = make_offloader(disk_dir)
    assert torch.equal(run(off), expected)
    assert off.stats().offloaded_bytes > 0
    off.close()


def test_no_grad_forward_and_parameters_skipped(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    off = make_offloader(disk_dir, min_bytes=1)
    lin = nn.Linear(1024, 1024)  # 4 MiB weight: saved as weight.t(), must not be moved
    frozen = nn.Linear(1024, 1024).requires_grad_(False)  # its weight.t() is saved for x's grad
    x = torch.randn(8, 1024, requires_grad=True)
    with off, torch.no_grad():
        lin(x)
    assert off.stats().saved_tensors == 0
    with off:
        loss = lin(frozen(x)).sum()
    st = off.stats()
    assert st.offloaded_bytes < 1 << 20  # only the small activations, never a weight
    assert st.kept_bytes >= 2 * 1024 * 1024 * 4
    loss.backward()
    off.close()


def test_unpack_after_close_raises(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    off = make_offloader(disk_dir)
    x = torch.randn(N, N, requires_grad=True)
    with off:
        z = (x * 2).sin()
    off.close()
    off.close()  # idempotent
    with pytest.raises(RuntimeError, match="close"):
        z.sum().backward()
    with pytest.raises(RuntimeError, match="closed"), off:
        pass


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_200_steps_no_growth(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    off = make_offloader(disk_dir)
    m = nn.Sequential(
        nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 1)
    )
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(256, 64)
    snapshots = []
    for step in range(200):
        with off:
            loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        del loss
        off.synchronize()
        st = off.stats()
        assert st.resident_bytes == 0 and st.disk_bytes == 0
        if step in (20, 199):
            snapshots.append((st.peak_disk_bytes, st.peak_resident_bytes, _open_fds()))
        assert not list(disk_dir.iterdir())
    (disk20, _res20, fds20), (disk199, res199, fds199) = snapshots
    assert fds199 == fds20
    # Peaks depend on I/O timing (what is forwarded vs written), so they may differ a little,
    # but they are bounded by one step's worth, not by the number of steps.
    step_bytes = st.saved_bytes // 200
    assert disk199 <= disk20 + step_bytes // 2
    cfg = off.config
    assert res199 <= cfg.staging_bytes + cfg.prefetch_bytes + step_bytes
    off.close()


def test_unsupported_tensors_are_kept(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    dense = torch.randn(512, 512)
    cases = {
        "sparse": dense.to_sparse(),
        "meta": torch.empty(512, 512, device="meta"),
        "conj": torch.randn(256, 512, dtype=torch.complex64).conj(),
        "dense": dense,
    }
    off = make_offloader(disk_dir, min_bytes=1)
    SavePayload.seen.clear()
    x = torch.ones(1, requires_grad=True)
    with off:
        outs = [SavePayload.apply(x, c) for c in cases.values()]
    st = off.stats()
    assert st.offloaded_bytes == dense.nbytes  # only the plain dense tensor moved
    torch.autograd.backward(outs, [torch.ones(1)] * len(outs))
    for got, (name, want) in zip(reversed(SavePayload.seen), cases.items(), strict=True):
        if name != "meta":
            assert torch.equal(
                got.to_dense() if got.is_sparse else got,
                want.to_dense() if want.is_sparse else want,
            )
    off.close()


@pytest.mark.parametrize("trim_bytes", [0, 1 << 20])
def test_heap_trim_cadence(make_offloader: MakeOffloader, trim_bytes: int, disk_dir: Path) -> None:
    off = make_offloader(disk_dir, trim_host_bytes=trim_bytes)
    calls: list[int] = []
    if off.runtime.ledger._trim is not None:
        off.runtime.ledger._trim = lambda pad: calls.append(pad) or 1  # type: ignore[assignment]
    x = torch.randn(N, N, requires_grad=True)
    with off:
        h = x
        for _ in range(8):
            h = (h * 1.01).sin()  # 2 MiB saved per layer
    h.sum().backward()
    moved = off.stats().offloaded_bytes
    if trim_bytes:
        assert len(calls) >= moved // trim_bytes  # out and back in: about twice that
    else:
        assert off.runtime.ledger._trim is None and not calls
    off.close()


def test_dedup_never_joins_aliases_with_separate_version_counters(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """``x.data`` shares x's storage but not its version counter: no dedup across them."""

    def run(off: object) -> list[torch.Tensor]:
        torch.manual_seed(0)
        x = torch.randn(N, N)
        w1 = torch.randn(N, N, requires_grad=True)
        w2 = torch.randn(N, N, requires_grad=True)
        ctx = (
            off
            if off is not None
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with ctx:  # type: ignore[attr-defined]
            a = x @ w1  # saves x at version 0
            x.data.mul_(3)  # in place through an alias with its own version counter
            b = x.data @ w2  # saves a fresh alias of the same storage, also at version 0
        (a.sum() + b.sum()).backward()
        return [w1.grad, w2.grad]  # type: ignore[list-item]

    expected = run(None)
    off = make_offloader(disk_dir)
    got = run(off)
    # w2: b saved the mutated value; a stale dedup hit on a's block would give the old one.
    assert torch.equal(got[1], expected[1])
    # w1: x is captured once ``a``'s op has returned, at the next pack (b's), so after the
    # write through ``x.data``: the live value eager PyTorch uses too.
    assert torch.equal(got[0], expected[0])
    off.close()


def _make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


def _train_in_two_threads(off: Offloader, x: torch.Tensor) -> list[nn.Module]:
    models = [_make_mlp(), _make_mlp()]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def work(m: nn.Module) -> None:
        try:
            barrier.wait()
            with off:
                loss = m(x).square().mean()
            loss.backward()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    return models


def test_two_threads_packing_at_once(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    x = torch.randn(512, 256)
    ref = _make_mlp()
    ref(x).square().mean().backward()
    expected = [p.grad for p in ref.parameters()]
    for _ in range(10):  # the first pack of each Offloader creates its pool: race it
        off = make_offloader(disk_dir)
        for m in _train_in_two_threads(off, x):
            assert all(
                torch.equal(p.grad, e) for p, e in zip(m.parameters(), expected, strict=True)
            )
        staging = [p for p in off.runtime.writer.pools if isinstance(p, SlotPool)]
        # one staging pool, or none where CPU tensors are written in place
        assert len(staging) == (0 if off.runtime.writer.in_place is not None else 1)
        off.close()


def test_memory_fallback_chunk_of_unaligned_size(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When no staging slot can ever be had, the chunk stays in memory, padded like the rest."""
    off = make_offloader(disk_dir, min_bytes=1, io_engine=StagedEngine(2))
    assert off.runtime.writer.in_place is None
    monkeypatch.setattr(off.runtime.writer, "_acquire_slot", lambda pool: None)
    payload = torch.randint(0, 256, (3 * 65536 + 7,), dtype=torch.uint8)
    SavePayload.seen.clear()
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, payload)
    y.sum().backward()
    assert torch.equal(SavePayload.seen[0], payload)
    off.close()


def test_unclosed_offloader_is_collected(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """An Offloader dropped without close() is collected (its finalizer closes files and
    threads): no idle I/O thread keeps it alive through its last request's callback."""
    import gc
    import weakref

    off = make_offloader(disk_dir, min_bytes=1)
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, torch.randn(1 << 16))
    off.synchronize()
    y.sum().backward()
    ref = weakref.ref(off)
    del off, y
    gc.collect()
    assert ref() is None
