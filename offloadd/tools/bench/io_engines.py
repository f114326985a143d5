"""The engines' side of ``offloadd bench io``: a pass of requests through one engine, timed.

:class:`Target` holds the engine's offload files (one per directory) and its buffers; each
:meth:`Target.run` submits all of a pass's requests at once and returns a :class:`Timing`, the
wall and CPU time of the whole process. :func:`spin_while` is the GIL-holding loop of ``--gil``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offloadd.io.buffers import AlignedBuffer
from offloadd.io.files import SlotFile
from offloadd.io.hugepages import advise_huge_pages
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Engine, Op, Request

__all__ = ["ENGINES", "Target", "Timing", "make_engine", "spin_while"]

ENGINES = ("native-uring", "native-threads", "python")
_GB = 1e9


@dataclass(slots=True)
class Timing:
    """One timed pass (of an engine or of fio): wall seconds, CPU seconds and bytes moved;
    ``reported_s``: the run time fio itself reported (see [fio's wall span]), None for engines."""

    seconds: float
    cpu_s: float
    nbytes: int
    reported_s: float | None = None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / _GB

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.nbytes / _GB)


def make_engine(name: str, threads: int, chunk_bytes: int) -> Engine:
    """A new engine ``name`` (one of ``ENGINES``); offloadd.io.native is imported only for those."""
    if name == "python":
        return PythonEngine(threads)
    from offloadd.io.native import NativeEngine

    backend = name.removeprefix("native-")
    return NativeEngine(threads, chunk_bytes=chunk_bytes, backend=backend, depth=2 * threads)


class _Run:
    """All requests of one pass in flight at once; ``wait`` returns when every one called back."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, r: Request) -> None:
        with self.lock:
            if r.error is not None:
                self.errors.append(r.error)
            self.left -= 1
            if self.left == 0:
                self.done.set()

    def wait(self) -> None:
        self.done.wait()
        if self.errors:
            raise self.errors[0]


class Target:
    """The engine's files (one per directory), the source buffers and the read-back buffers,
    on huge pages unless ``huge_pages`` is False (see [huge-page buffers])."""

    def __init__(
        self, dirs: list[str], total: int, request: int, window: int, *, huge_pages: bool = True
    ) -> None:
        self.files = [SlotFile(d, request, "on") for d in dirs]
        self.n = total // request
        self.request = request
        self.where = []
        for i in range(self.n):
            f = self.files[i % len(self.files)]
            self.where.append((f, f.alloc()))
        self.window = min(window, self.n)
        self.src = [AlignedBuffer(request) for _ in range(self.window)]
        for k, b in enumerate(self.src):  # distinct content per buffer: a misplaced read shows
            b.tensor.copy_(
                torch.randint(
                    0,
                    256,
                    (request,),
                    dtype=torch.uint8,
                    generator=torch.Generator().manual_seed(k),
                )
            )
        self.dst = [AlignedBuffer(request) for _ in range(self.window)]
        # as the product's staging slots ([huge-page buffers]); False where refused or not asked
        self.huge_pages = huge_pages and all(
            advise_huge_pages(b.address, b.nbytes) for b in self.src + self.dst
        )

    def run(self, engine: Engine, op: Op) -> Timing:
        bufs = self.src if op is Op.WRITE else self.dst
        run = _Run(self.n)
        reqs = [
            Request(op, f.fd, f.path, off, bufs[i % self.window].address, self.request, run)
            for i, (f, off) in enumerate(self.where)
        ]
        cpu0, t0 = time.process_time(), time.perf_counter()
        for r in reqs:
            engine.submit(r)
        run.wait()
        t1, cpu1 = time.perf_counter(), time.process_time()
        return Timing(t1 - t0, cpu1 - cpu0, self.n * self.request)

    def verify(self, engine: Engine) -> None:
        """Read each request back into its own buffer and compare with what was written."""
        for start in range(0, self.n, self.window):
            idx = list(range(start, min(self.n, start + self.window)))
            run = _Run(len(idx))
            for j, i in enumerate(idx):
                f, off = self.where[i]
                engine.submit(
                    Request(Op.READ, f.fd, f.path, off, self.dst[j].address, self.request, run)
                )
            run.wait()
            for j, i in enumerate(idx):
                if not torch.equal(self.dst[j].tensor, self.src[i % self.window].tensor):
                    raise RuntimeError(f"bench io: request {i} read back different bytes")

    def close(self) -> None:
        for b in self.src + self.dst:
            b.close()
        for f in self.files:
            f.close()


def spin_while(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` in a thread while this thread spins in pure Python (GIL held); its result and
    the number of spins."""
    out: list[Any] = []
    err: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=target)
    spins = 0
    t.start()
    while t.is_alive():
        for _ in range(1000):  # pure bytecode: never releases the GIL on its own
            spins += 1
    t.join()
    if err:
        raise err[0]
    return out[0], spins
