"""Several threads through one Offloader on the simulated asynchronous device.

``nn.DataParallel`` under ``OFFLOADD=1`` forwards its replicas on one thread each through the
same Offloader, and autograd runs backward on threads of its own. With
:class:`~offloadd.runtime.simulated.SimulatedOrdering` every copy into a slot completes late, on
a worker thread, so a write (or a spill of the cpu tier) that does not wait for the right copy
writes a slot that holds stale bytes, and the gradients differ from the run without offloading.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from offloadd import Offloader
from offloadd.runtime.simulated import SimulatedOrdering
from tests._support.helpers import MakeOffloader, assert_bitwise_equal

# Engine-independent: the embedded native engine (tests/runtime/test_ordering.py runs every engine).
ENGINE_PARAMS = ("native-threads",)

_THREADS = 3
_STEPS = 6


def _model(seed: int, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64)
    ).to(device)


def _run(
    off: Offloader | None,
    backward_on: Callable[[Callable[[], None]], None] | None,
    device: str = "cpu",
) -> list[list[list[torch.Tensor]]]:
    """``_THREADS`` replicas trained at once, one forward thread each; each replica's losses and
    gradients per step. Backward runs on ``backward_on``'s threads (None: the forward thread)."""
    results: list[list[list[torch.Tensor]]] = [[] for _ in range(_THREADS)]
    models = [_model(i, device) for i in range(_THREADS)]  # the global RNG: not in the threads
    errors: list[BaseException] = []
    barrier = threading.Barrier(_THREADS)

    def replica(i: int) -> None:
        try:
            model = models[i]
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            gen = torch.Generator().manual_seed(100 + i)
            barrier.wait()
            for _ in range(_STEPS):
                x = torch.randn(96, 64, generator=gen).to(device)
                if off is None:
                    loss = model(x).square().mean()
                else:
                    with off:
                        loss = model(x).square().mean()
                if backward_on is None:
                    loss.backward()
                else:
                    backward_on(loss.backward)
                grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                results[i].append([loss.detach().clone(), *grads])
                opt.step()
                opt.zero_grad()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(_THREADS)]
    for t in threads:
        t.daemon = True  # a hung replica fails the test below instead of hanging the run
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a replica hung (waiting for a slot?)"
    if errors:
        raise errors[0]
    return results


@pytest.mark.usefixtures("fast_switching")
@pytest.mark.parametrize("tier", ["cpu", "ssd"])
def test_threads_forwarding_through_one_offloader(
    make_offloader: MakeOffloader, tier: str, disk_dir: Path, request: pytest.FixtureRequest
) -> None:
    """Three forward threads through one Offloader, backward on a pool of other threads,
    copies completing late: every replica's gradients are bit-identical to training it alone.

    The cpu tier's host pool holds 4 chunks, so forward spills constantly: a spill of a chunk
    whose copy another thread has not even enqueued yet wrote stale bytes to disk, and freed the
    slot under the late copy (item 3)."""
    reference = _run(None, None)
    sim = SimulatedOrdering(seed=zlib.crc32(request.node.name.encode()), max_delay_s=0.002)
    off = make_offloader(
        disk_dir,
        tier=tier,
        ordering=sim,
        chunk_bytes=16 << 10,
        staging_bytes=64 << 10,
        host_budget_bytes=64 << 10,
        prefetch_bytes=64 << 10,
    )
    try:
        with ThreadPoolExecutor(2, thread_name_prefix="backward") as pool:
            got = _run(off, lambda f: pool.submit(f).result())
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
        sim.close()
    assert sim.copies > 0, "the simulated device was not used"
    assert st.bytes_written > 0 and st.bytes_read > 0, st.summary()
    for i in range(_THREADS):
        assert_bitwise_equal(reference[i], got[i])
    assert st.resident_bytes == 0 and st.disk_bytes == 0


@pytest.mark.cuda
def test_threads_forwarding_through_one_offloader_cuda(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """The same on a GPU, with CUDA's own streams and events, tier cpu with a host pool of
    4 chunks (spills)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    reference = _run(None, None, "cuda")
    off = make_offloader(
        disk_dir, tier="cpu", chunk_bytes=16 << 10, host_budget_bytes=64 << 10, min_bytes=4096
    )
    try:
        with ThreadPoolExecutor(2, thread_name_prefix="backward") as pool:
            got = _run(off, lambda f: pool.submit(f).result(), "cuda")
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert st.bytes_written > 0, st.summary()
    for i in range(_THREADS):
        assert_bitwise_equal(reference[i], got[i])


@pytest.mark.cuda
def test_data_parallel_cpu_tier(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """``nn.DataParallel`` over two GPUs: its replicas forward on a thread each, through one
    Offloader (entered on each thread, as ``OFFLOADD=1``'s module scope does)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("nn.DataParallel forwards on threads only with two or more GPUs")
    off = make_offloader(
        disk_dir, tier="cpu", chunk_bytes=16 << 10, host_budget_bytes=64 << 10, min_bytes=4096
    )

    class Scoped(nn.Module):
        def __init__(self, inner: nn.Module, off: Offloader | None) -> None:
            super().__init__()
            self.inner, self.off = inner, off

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.off is None:
                return self.inner(x)
            with self.off:  # on the replica's own thread
                return self.inner(x)

    def train_dp(o: Offloader | None) -> list[list[torch.Tensor]]:
        model = nn.DataParallel(Scoped(_model(0, "cuda"), o))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator(device="cuda").manual_seed(1)
        out = []
        for _ in range(_STEPS):
            x = torch.randn(512, 64, device="cuda", generator=gen)
            loss = model(x).square().mean()
            loss.backward()
            out.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return out

    reference = train_dp(None)
    try:
        got = train_dp(off)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert st.bytes_written > 0, st.summary()
    assert_bitwise_equal(reference, got)


def test_a_copy_that_fails_leaves_no_chunk_marked_filling(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """A copy into a slot that raises: the tensor is kept (a warning), the chunk's mark is
    cleared by the capture's handler, and later forwards take slots without waiting on it."""
    sim = SimulatedOrdering(seed=3)
    off = make_offloader(
        disk_dir, tier="cpu", ordering=sim, chunk_bytes=16 << 10, host_budget_bytes=64 << 10
    )
    real_copy, calls = sim.copy, [0]

    def copy_fails_once(stream: object, dst: torch.Tensor, src: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("copy failed")
        real_copy(stream, dst, src)

    sim.copy = copy_fails_once  # type: ignore[method-assign]
    reference = _run(None, None)
    try:
        with pytest.warns(RuntimeWarning, match="offloading failed"):
            got = _run(off, None)
        assert off.runtime.writer.filling == 0
        st = off.stats()
    finally:
        off.close()
        sim.close()
    assert st.fallbacks >= 1
    for i in range(_THREADS):
        assert_bitwise_equal(reference[i], got[i])
