"""An Offloader collected on one of its own I/O threads: see [shutdown] in
offloadd/runtime/shutdown.py."""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from offloadd import Offloader
from offloadd.io.request import mark_engine_thread
from tests._support.helpers import MakeOffloader, SavePayload


@pytest.fixture
def unraisable() -> Iterator[list[str]]:
    """What finalizers and threads raised, instead of pytest's warning at some later test."""
    seen: list[str] = []
    old_unraisable, old_thread = sys.unraisablehook, threading.excepthook
    sys.unraisablehook = lambda u: seen.append(f"{u.exc_type.__name__}: {u.exc_value}")
    threading.excepthook = lambda a: seen.append(f"{a.exc_type.__name__}: {a.exc_value}")
    yield seen
    sys.unraisablehook, threading.excepthook = old_unraisable, old_thread


def _gate_writes(off: Offloader, gate: threading.Event) -> None:
    """Hold every write of ``off`` on its backend until ``gate`` is set."""
    backend = off.runtime.backend
    assert backend is not None
    real = backend.submit

    def submit(request: Any, **kw: Any) -> None:
        request.before = gate.wait
        real(request, **kw)

    backend.submit = submit  # type: ignore[method-assign]


@pytest.mark.usefixtures("backend")
def test_collected_with_writes_in_flight(
    make_offloader: MakeOffloader, disk_dir: Path, unraisable: list[str]
) -> None:
    """Requests hold the write path, never the Offloader: an unclosed one whose writes are in
    flight is collected as soon as its graph is gone, and its finalizer waits for those writes
    before it frees the pools (see [shutdown])."""
    ran_on: list[str] = []
    others = set(threading.enumerate())
    off = make_offloader(disk_dir, min_bytes=1)
    gate = threading.Event()
    _gate_writes(off, gate)
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, torch.randn(1 << 16))
    ref = weakref.ref(off)
    weakref.finalize(off, lambda: ran_on.append(threading.current_thread().name))
    mine = [t for t in threading.enumerate() if t not in others and "offloadd" in t.name]
    box: dict[str, Any] = {"off": off, "y": y}
    del off, y
    dropper = threading.Thread(target=box.clear, name="dropper")  # the graph holds the hooks
    dropper.start()
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ref() is None, "the writes in flight kept the Offloader alive"
    time.sleep(0.2)
    assert dropper.is_alive(), "the finalizer did not wait for the writes in flight"
    gate.set()
    dropper.join(10)
    assert not dropper.is_alive()
    assert ran_on == ["dropper"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the engine's threads end
        alive = [t for t in mine if t.is_alive()]
        if not alive:
            break
        time.sleep(0.01)
    assert not alive, alive
    assert unraisable == []


def test_shutdown_on_an_io_thread_moves_to_a_fresh_thread(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """A finalizer run on an I/O thread (a garbage collection there) must not close the
    backend from it: closing joins that very thread. It hands the shutdown to a new thread."""
    off = make_offloader(disk_dir)
    ran_on: list[str] = []
    real_close = off.runtime.backend.close  # type: ignore[union-attr]

    def close() -> None:
        ran_on.append(threading.current_thread().name)
        real_close()

    off.runtime.backend.close = close  # type: ignore[method-assign,union-attr]

    def on_io_thread() -> None:
        mark_engine_thread()
        off.runtime.finalizer()

    t = threading.Thread(target=on_io_thread, name="offloadd-io-test")
    t.start()
    t.join(10)
    deadline = time.monotonic() + 10
    while not ran_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran_on == ["offloadd-shutdown"]
