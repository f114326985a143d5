"""An Offloader collected on one of its own I/O threads (issue 11): see [shutdown] in
offloadd/runtime/offloader.py."""

from __future__ import annotations

import gc
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

from .helpers import SavePayload, small_offloader


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
    backend = off._backend
    assert backend is not None
    real = backend.submit

    def submit(request: Any, **kw: Any) -> None:
        request.before = gate.wait
        real(request, **kw)

    backend.submit = submit  # type: ignore[method-assign]


@pytest.mark.usefixtures("backend")
def test_collected_on_an_io_thread(
    disk_dir: Path, unraisable: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last reference to an unclosed Offloader is a write's callback: it is collected on
    the I/O thread, whose finalizer must neither join that thread nor deadlock."""
    ran_on: list[str] = []
    real_shutdown = Offloader._shutdown

    def shutdown(*args: Any) -> None:
        ran_on.append(threading.current_thread().name)
        real_shutdown(*args)

    monkeypatch.setattr(Offloader, "_shutdown", staticmethod(shutdown))
    others = set(threading.enumerate())
    off = small_offloader(disk_dir, min_bytes=1)
    gate = threading.Event()
    _gate_writes(off, gate)
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, torch.randn(1 << 16))
    ref = weakref.ref(off)
    del off, y  # the graph holds the unpack hook, and so the Offloader
    gc.collect()
    assert ref() is not None  # held by the writes in flight
    mine = [t for t in threading.enumerate() if t not in others and "offloadd" in t.name]
    gate.set()
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # no gc.collect() here: it would collect it on this thread
    assert ref() is None
    assert ran_on and ran_on[0].startswith("offloadd-"), ran_on  # on an I/O thread
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the engine's threads end: nothing joined itself
        alive = [t for t in mine if t.is_alive()]
        if not alive:
            break
        time.sleep(0.01)
    assert not alive, alive
    assert unraisable == []
