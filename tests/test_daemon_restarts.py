"""A daemon lost and restarted between steps, again and again (issue 31, items 4 and 7): the
client holds no more descriptors, file space or shared memory than after its first step, and
trains bit-identically to a run without offloadd."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch

from offloadd import Offloader
from offloadd.io.request import Op

from .daemon_proc import DaemonProc, held_descriptors
from .helpers import assert_bitwise_equal, small_offloader, train
from .test_equivalence import MODELS


def _held(off: Offloader, dirs: list[str]) -> dict[str, int]:
    """What this process holds: all its descriptors, the offload files and memfds among them,
    and the file space kept allocated by descriptors of files that are not the current
    session's (a dead daemon's unlinked files keep their space while a descriptor is open)."""
    backend = off._backend
    current = backend._current if backend is not None else None  # type: ignore[attr-defined]
    own = set(current.file_fds) if current is not None else set()
    fd_dir = "/proc/self/fd"
    fds = os.listdir(fd_dir)
    space = 0
    for name in fds:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
            if int(name) not in own and any(target.startswith(d.rstrip("/") + "/") for d in dirs):
                space += os.stat(os.path.join(fd_dir, name)).st_blocks * 512
        except OSError:
            continue  # the listing's own descriptor, or one closed meanwhile
    held = held_descriptors(os.getpid(), dirs)
    return {"fds": len(fds), "lost_sessions_space": space, **held}


def _wait_lost(off: Offloader) -> None:
    backend = off._backend
    assert backend is not None
    deadline = time.monotonic() + 10
    while backend.connected:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the client did not notice the daemon's loss"
        time.sleep(0.01)


def _train(
    off: Offloader,
    steps: int,
    between: Callable[[int], None],
    before_backward: Callable[[int], None] = lambda step: None,
) -> list[list[torch.Tensor]]:
    make_model, make_input = MODELS["gpt"]
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        x = make_input(gen)
        with off:
            loss = model(x).float().square().mean()
        off.synchronize()  # every block written: backward reads them all back
        before_backward(step)
        loss.backward()
        rng = torch.get_rng_state()
        out.append([loss.detach().clone(), rng, *(p.grad.clone() for p in model.parameters())])
        opt.step()
        opt.zero_grad()
        off.synchronize()
        between(step)
    return out


@pytest.mark.filterwarnings("ignore:offloadd. lost the daemon:RuntimeWarning")
def test_three_restarts_between_steps_leak_nothing(
    own_daemon: Callable[..., DaemonProc],
) -> None:
    """Killed (SIGKILL), stopped (SIGTERM, as ``offloadd stop``) and killed again while the
    client is idle between steps; each time a new daemon is started on the same socket."""
    steps = 6
    reference = train(*MODELS["gpt"], None, steps=steps)
    first = own_daemon().start()
    dirs = [str(d) for d in first.dirs]
    off = small_offloader(first.dirs[0], daemon={"socket": first.socket})
    current = [first]
    seen: list[dict[str, int]] = []

    def between(step: int) -> None:
        seen.append(_held(off, dirs))
        if 1 <= step <= 3:
            old = current[0]
            if step == 2:
                assert old.stop() == 0
            else:
                old.kill()
            _wait_lost(off)
            current[0] = own_daemon(dirs=old.dirs).start()

    try:
        got = _train(off, steps, between)
        st = off.stats()
    finally:
        off.close()
    assert_bitwise_equal(reference, got)
    assert st.bytes_written > 0 and st.bytes_read > 0
    # After the first step and after the step that follows each restart: the same holdings.
    # (Step 1 is the first whose holdings can be compared: step 0 may still see start-up.)
    assert seen[2:] == [seen[1]] * (steps - 2), seen
    assert seen[1]["files"] > 0 and seen[1]["memfds"] == 1
    assert held_descriptors(os.getpid(), dirs) == {"files": 0, "memfds": 0, "mappings": 0}


class _LateDaemon:
    """Plays a lost daemon that is still alive: writes garbage, again and again, into the read
    slots whose reads were in flight when the client lost it (as the real one completes them,
    late, into the session's shared memory)."""

    def __init__(self, off: Offloader, slots: list[int]) -> None:
        backend = off._backend
        assert backend is not None and slots
        base = backend._buffer.address + backend.staging_bytes  # type: ignore[attr-defined]
        chunk = backend.chunk_bytes  # type: ignore[attr-defined]
        self.ranges = [(base + s * chunk, chunk) for s in slots]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="late-daemon", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for address, n in self.ranges:
                ctypes.memset(address, 0xFF, n)  # NaN in every float
            time.sleep(0.0005)

    def end(self) -> None:
        self.stop.set()
        self.thread.join()


def _lose_during_reads(off: Offloader, daemon: DaemonProc) -> list[int]:
    """With ``daemon`` paused and backward waiting on its reads: note the read slots in
    flight, break the connection from the client's side (the daemon lives on), continue the
    daemon. Returns the slots."""
    backend = off._backend
    gen = backend._current  # type: ignore[attr-defined]
    deadline = time.monotonic() + 20
    slots: list[int] = []
    while True:
        with backend._lock:  # type: ignore[attr-defined]
            now = sorted(slot for req, slot in gen.pending.values() if req.op is Op.READ)
        if now and now == slots:  # the client sent all it will until one completes
            break
        assert time.monotonic() < deadline, "backward sent no read to the paused daemon"
        slots = now
        time.sleep(0.2)
    gen.sock.shutdown(socket.SHUT_RDWR)
    daemon.resume()
    return slots


@pytest.mark.filterwarnings("ignore:offloadd. lost the daemon:RuntimeWarning")
def test_read_slots_of_a_live_lost_daemon_are_never_reused(
    own_daemon: Callable[..., DaemonProc],
) -> None:
    """The client drops the connection while its reads are queued in a (paused) daemon, which
    then goes on and completes them into the shared memory, whenever it likes; the client
    reconnects to the same daemon (same memfd). The slots of those reads stay out of use until
    that daemon process has exited (Note [read slots after a loss]), so backward never copies
    out bytes the lost session wrote: gradients stay bit-identical."""
    steps = 5
    reference = train(*MODELS["gpt"], None, steps=steps)
    d = own_daemon().start()
    off = small_offloader(d.dirs[0], daemon={"socket": d.socket})
    backend = off._backend
    assert backend is not None
    lost_slots: list[int] = []
    loser: list[threading.Thread] = []
    late: list[_LateDaemon] = []

    def before_backward(step: int) -> None:
        if step == 1:
            d.pause()
            loser.append(
                threading.Thread(target=lambda: lost_slots.extend(_lose_during_reads(off, d)))
            )
            loser[0].start()

    def between(step: int) -> None:
        if step == 1:
            loser[0].join()
            _wait_lost(off)
            late.append(_LateDaemon(off, lost_slots))
        elif step == 3:
            # Still the same daemon process: its slots are still out of use.
            assert backend._read_slots.quarantined == len(lost_slots)  # type: ignore[attr-defined]
            late[0].end()
            assert d.stop() == 0  # it has exited: the next reconnect brings them back
            own_daemon(dirs=d.dirs).start()

    try:
        got = _train(off, steps, between, before_backward)
        st = off.stats()
        quarantined = backend._read_slots.quarantined  # type: ignore[attr-defined]
    finally:
        for x in late:
            x.end()
        off.close()
    assert lost_slots, "no read was in flight at the loss"
    assert_bitwise_equal(reference, got)
    assert st.bytes_read > 0
    assert quarantined == 0
