"""Shared pieces of the tests: reference runs, gradient comparison, a payload-saving Function."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

from offloadd import Config, Offloader, Stats
from offloadd.io.engine_choice import open_host_engine
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Engine, Op, Request

ENGINE_OPTIONS: dict[str, dict[str, str]] = {
    "native-uring": {"engine": "native", "io_uring": "on"},
    "native-threads": {"engine": "native", "io_uring": "off"},
    "python": {"engine": "python"},
    "default": {},  # what users get: engine = auto
}

#: The ``make_offloader`` fixture (tests/conftest.py): :func:`small_offloader` with the test's
#: engine and backend options, which the call's own options override.
MakeOffloader = Callable[..., Offloader]
#: The ``make_engine`` fixture: :func:`open_engine` on the test's engine, given its threads.
MakeEngine = Callable[[int], Engine]


def open_engine(num_threads: int, options: Mapping[str, str]) -> Engine:
    """A standalone engine with ``options`` (one of :data:`ENGINE_OPTIONS`)."""
    engine, _ = open_host_engine(Config(io_threads=num_threads, **options))  # type: ignore[arg-type]
    return engine


def small_offloader(disk_dir: object, **kw: object) -> Offloader:
    """An Offloader sized so tiny models still exercise chunking, staging and prefetch, on the
    default engine unless ``kw`` names one (tests on the engine and backend they are run on
    take the ``make_offloader`` fixture instead, which passes theirs)."""
    opts: dict[str, object] = dict(
        tier="ssd",
        ssd_dirs=[str(disk_dir)],
        min_bytes=4096,
        chunk_bytes=64 << 10,
        staging_bytes=1 << 20,
        prefetch_bytes=512 << 10,
        io_threads=2,
    )
    opts.update(kw)
    daemon = opts.get("daemon")
    if isinstance(daemon, dict) and daemon.get("socket") and "io_engine" in opts:
        pytest.skip(
            "an injected engine is embedded-only; tests/daemon/test_daemon.py covers the daemon"
        )
    if opts["tier"] == "keep":
        opts.pop("ssd_dirs")
    return Offloader(**opts)  # type: ignore[arg-type]


def train(
    make_model: Callable[[], nn.Module],
    make_input: Callable[[torch.Generator], torch.Tensor],
    off: Offloader | None,
    *,
    steps: int = 3,
    seed: int = 0,
    settle_first: bool = False,
) -> list[list[torch.Tensor]]:
    """Run ``steps`` SGD steps from ``seed``; return each step's gradients (and the loss).

    ``settle_first``: the first step's writes complete before its backward (``synchronize``),
    so that step reads back from disk whatever the timing; the later steps race as in use."""
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for step in range(steps):
        x = make_input(gen)
        if off is None:
            loss = model(x).float().square().mean()
        else:
            with off:
                loss = model(x).float().square().mean()
            if settle_first and step == 0:
                off.synchronize()
        loss.backward()
        rng = torch.get_rng_state()  # same RNG use, e.g. by dropout
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]  # not frozen
        out.append([loss.detach().clone(), rng, *grads])
        opt.step()
        opt.zero_grad()
    return out


def train_and_compare(
    make_model: Callable[[], nn.Module],
    make_input: Callable[[torch.Generator], torch.Tensor],
    off: Offloader,
    *,
    settle_first: bool = False,
) -> Stats:
    """Train with ``off`` and without offloading; assert bit-identical results; return the
    Offloader's stats once its I/O settled (it is closed afterwards either way)."""
    reference = train(make_model, make_input, None)
    try:
        got = train(make_model, make_input, off, settle_first=settle_first)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert_bitwise_equal(reference, got)
    return st


def linked_tensors() -> int:
    """Plain tensors alive with a grad_fn, after a collection: a graph's outputs, never a
    parameter, a slab's handle or a relayed weight's placeholder (a subclass, which raises on
    ``grad_fn``). What a dropped graph leaves when a hook kept an op's output with its graph."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.grad_fn is not None)


def assert_bitwise_equal(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for step, (ga, gb) in enumerate(zip(a, b, strict=True)):
        for i, (x, y) in enumerate(zip(ga, gb, strict=True)):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y), f"step {step}, tensor {i} differs (max {(x - y).abs().max()})"


class StagedEngine(PythonEngine):
    """The reference engine without head/tail pages: host tensors go through staging slots
    instead of being written in place (the path CUDA tensors and the daemon take)."""

    writes_pages = False


class SlowEngine(PythonEngine):
    """The reference engine with every write delayed, so the staging pool must fill.
    ``pages=False``: host tensors go through staging (see :class:`StagedEngine`)."""

    def __init__(self, delay_s: float = 0.005, *, pages: bool = True) -> None:
        super().__init__(2)
        self.delay_s = delay_s
        self.writes_pages = pages

    def submit(self, request: Request) -> None:
        if request.op is Op.WRITE:
            request.before = lambda: time.sleep(self.delay_s)
        super().submit(request)


class SavePayload(torch.autograd.Function):
    """Saves an arbitrary tensor for backward and records what backward got back."""

    seen: ClassVar[list[torch.Tensor]] = []

    @staticmethod
    def forward(ctx, x, payload):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(payload)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (payload,) = ctx.saved_tensors
        SavePayload.seen.append(payload.clone())
        return g, None


@contextlib.contextmanager
def loop_ext4(root: Path, mib: int = 16, *, reserved: bool = True) -> Iterator[Path]:
    """A real ext4 file system of ``mib`` MiB, its image under ``root``, loop-mounted for the
    ``with`` block: it fills up for real (ENOSPC). ``reserved=False``: no blocks kept for root.
    Skips the test without root, mkfs.ext4 or loop mounts."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("a loop-mounted file system needs root and mkfs.ext4")
    image, mnt = root / "fs.img", root / "mnt"
    with open(image, "wb") as f:
        f.truncate(mib << 20)
    mkfs = ["mkfs.ext4", "-q", "-F", *(() if reserved else ("-m", "0")), str(image)]
    subprocess.run(mkfs, check=True, capture_output=True)
    mnt.mkdir()
    done = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot loop-mount here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
