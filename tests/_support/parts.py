"""The runtime's parts wired by hand, as ``Runtime`` wires them, for the tests of one part at a
time (tests/runtime/test_writer.py, test_reader.py, test_lifetime.py): no hooks, no autograd.

:meth:`Parts.pack` does what the pack hook does to a tensor that moves (a block, pending, and a
ref to it), without the hook's filters (size, parameters, devices)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from offloadd.backend import open_backend
from offloadd.config import Config
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Engine, Op, Request
from offloadd.runtime.accounting import Ledger
from offloadd.runtime.blocks import Block, BlockMap
from offloadd.runtime.dedup import StorageIndex
from offloadd.runtime.handles import Ref
from offloadd.runtime.identity import Facts
from offloadd.runtime.lifetime import Lifetime
from offloadd.runtime.ordering import CudaOrdering
from offloadd.runtime.reader import Reader
from offloadd.runtime.shutdown import shutdown
from offloadd.runtime.writer import Writer
from tests._support.helpers import StagedEngine

CHUNK = 8 << 10  # small chunks: a few KiB make several


def config(directory: Path, **kw: Any) -> Config:
    """An ssd-tier config in ``directory`` with small chunks and pools (buffered I/O: the tests
    of parts do not depend on the file system's O_DIRECT rules)."""
    opts: dict[str, Any] = dict(
        tier="ssd",
        ssd_dirs=(str(directory),),
        min_bytes=0,
        chunk_bytes=CHUNK,
        staging_bytes=8 * CHUNK,
        prefetch_bytes=4 * CHUNK,
        io_threads=2,
        direct_io="off",
        trim_host_bytes=0,
    )
    opts.update(kw)
    return Config().replace(**opts)


def floats(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` random floats, the same for the same ``seed``."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


class Failing(StagedEngine):
    """Every request of ``op`` fails with ``err`` (``EIO``, ``ENOSPC``...), through staging."""

    def __init__(self, op: Op, err: int) -> None:
        super().__init__(2)
        self.op, self.err = op, err

    def submit(self, request: Request) -> None:
        if request.op is self.op:

            def fail() -> None:
                raise OSError(self.err, os.strerror(self.err), request.path)

            request.before = fail
        super().submit(request)


class HeldWrites(StagedEngine):
    """Writes that wait until let go, and may be cancelled meanwhile."""

    def __init__(self) -> None:
        super().__init__(2)
        self.held: list[Request] = []

    def submit(self, request: Request) -> None:
        if request.op is Op.WRITE:
            self.held.append(request)
        else:
            super().submit(request)

    def cancel(self, request: Request) -> bool:
        if request in self.held:
            self.held.remove(request)
            return True
        return False

    def let_go(self) -> None:
        held, self.held = self.held, []
        for r in held:
            super().submit(r)


class Parts:
    """A ledger, block map, storage index, backend, writer, reader and lifetime of one config."""

    def __init__(self, cfg: Config, engine: Engine | None = None) -> None:
        self.config = cfg
        self.ledger = Ledger(cfg.trim_host_bytes)
        self.blocks = BlockMap()
        self.index = StorageIndex(cfg.dedup)
        self.ordering = CudaOrdering()  # CPU tensors: nothing asynchronous
        engine = engine if engine is not None or cfg.tier == "keep" else PythonEngine(2)
        self.backend = open_backend(cfg, engine, self.ledger.warn_once)
        self.writer = Writer(cfg, self.ledger, self.blocks, self.backend, self.ordering)
        self.reader = Reader(self.writer)
        self.life = Lifetime(self.index, self.writer, self.reader)
        self.closed = False

    @property
    def stats(self) -> Any:
        return self.ledger.stats

    def pack(self, t: torch.Tensor) -> Ref:
        """The pack hook's work for ``t``: its block (joined through the index when dedup finds
        one), pending until :meth:`capture`; the ref autograd would hold."""
        facts = Facts(t)
        storage = facts.storage
        assert storage is not None
        with self.ledger.lock:
            self.life.drain()
            key = self.index.key(t, facts)
            root = facts.root
            block = self.index.lookup(key, root)
            if block is not None:
                block.refs += 1
                return Ref(block, t, self.life.released, keep=False)
            skew = self.writer.skew_of(t.device, storage.data_ptr())
            block = self.blocks.new(storage.nbytes(), t.device, self.config.chunk_bytes, skew)
            self.index.remember(key, storage, root, block)
            block.source = t.detach()
            block.handle = t.detach()  # shares the version counter
            block.source_ptr = storage.data_ptr()
            block.version = t._version
            self.ledger.add_resident(block.nbytes)
        self.life.captures.add(block)
        return Ref(block, t, self.life.released, keep=False)

    def capture(self, *blocks: Block) -> None:
        for block in blocks:
            self.life.capture(block)

    def settle(self) -> None:
        """Wait for every write and read in flight; apply the releases queued since."""
        with self.ledger.lock:
            self.life.settle()

    def unpack(self, ref: Ref) -> torch.Tensor:
        return self.reader.unpack(ref, self.life.drain, lambda: self.life.closed)

    def drain(self) -> None:
        with self.ledger.lock:
            self.life.drain()

    def live(self) -> list[Block]:
        with self.ledger.lock:
            return list(self.blocks)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.life.closed = True
        if self.backend is not None:
            self.backend.close()
        self.drain()
        shutdown(self.backend, self.writer.pools, self.ordering, False)


def parts_in(directory: Path, engine: Engine | None = None, **kw: Any) -> Iterator[Parts]:
    """A fixture's body: :class:`Parts` of :func:`config` in ``directory``; closed afterwards,
    and then no file may be left there."""
    parts = Parts(config(directory, **kw), engine)
    try:
        yield parts
    finally:
        parts.close()
    left = [p for p in directory.iterdir()]
    assert not left, f"files left behind: {left}"
