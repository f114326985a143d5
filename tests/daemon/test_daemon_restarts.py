"""A daemon lost and restarted between steps, again and again: the
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
from offloadd.backend.daemon_slots import DaemonProcess, ReadSlots
from offloadd.io.request import Op
from tests._support.daemon_proc import DaemonProc, held_descriptors
from tests._support.helpers import assert_bitwise_equal, small_offloader, train
from tests.properties.test_equivalence import MODELS


def _held(off: Offloader, dirs: list[str]) -> dict[str, int]:
    """What this process holds: all its descriptors, the offload files and memfds among them,
    and the file space kept allocated by descriptors of files that are not the current
    session's (a dead daemon's unlinked files keep their space while a descriptor is open)."""
    backend = off.runtime.backend
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
    backend = off.runtime.backend
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
        backend = off.runtime.backend
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
    backend = off.runtime.backend
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
@pytest.mark.parametrize("until", ["daemon-exits", "session-ends"])
def test_read_slots_of_a_live_lost_daemon_are_never_reused(
    until: str, own_daemon: Callable[..., DaemonProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client drops the connection while its reads are queued in a (paused) daemon, which
    then goes on and completes them into the shared memory, whenever it likes; the client
    reconnects to the same daemon (same memfd). The slots of those reads stay out of use until
    that daemon process has exited, or has ended the lost session (Note [read slots after a
    loss]), so backward never copies out bytes the lost session wrote: gradients stay
    bit-identical. Then each slot is back, once."""
    steps = 6
    reference = train(*MODELS["gpt"], None, steps=steps)
    d = own_daemon().start()
    off = small_offloader(d.dirs[0], daemon={"socket": d.socket}, prefetch_bytes=1 << 20)
    backend = off.runtime.backend
    assert backend is not None
    lost_slots: list[int] = []
    loser: list[threading.Thread] = []
    late: list[_LateDaemon] = []
    # The real daemon ends the lost session as soon as its reads are done (it was continued at
    # once); the late writer plays one still busy: its session stays listed while it writes.
    lost_session: list[int] = []
    real_sessions = backend._daemon_sessions  # type: ignore[attr-defined]

    def sessions() -> set[int] | None:
        now = real_sessions()
        if now is not None and late and not late[0].stop.is_set():
            now |= set(lost_session)
        return now

    monkeypatch.setattr(backend, "_daemon_sessions", sessions)

    def before_backward(step: int) -> None:
        if step == 1:
            lost_session.append(backend._current.session)  # type: ignore[attr-defined]
            d.pause()
            loser.append(
                threading.Thread(target=lambda: lost_slots.extend(_lose_during_reads(off, d)))
            )
            loser[0].start()

    def between(step: int) -> None:
        slots = backend._read_slots  # type: ignore[attr-defined]
        if step == 1:
            loser[0].join()
            _wait_lost(off)
            late.append(_LateDaemon(off, lost_slots))
        elif step == 3:
            assert backend.connected  # to the same daemon process again
            assert slots.quarantined == len(lost_slots)  # it is still writing
            late[0].end()
            if until == "daemon-exits":
                assert d.stop() == 0
                own_daemon(dirs=d.dirs).start()
        elif step == 4:  # the reconnect or the session's end brought them back
            assert slots.quarantined == 0
            assert sorted(slots.free) == list(range(slots.num_slots)), slots.free

    try:
        got = _train(off, steps, between, before_backward)
        st = off.stats()
    finally:
        for x in late:
            x.end()
        off.close()
    assert lost_slots, "no read was in flight at the loss"
    assert_bitwise_equal(reference, got)
    assert st.bytes_read > 0


def test_the_daemon_s_process_is_told_apart() -> None:
    """A quarantine ends when its daemon's process has exited: gone, a zombie, or its pid now
    another process's (compared by start time since boot, not by the wall clock)."""
    import subprocess

    a, b = socket.socketpair()
    with a, b:
        me = DaemonProcess.of(a)  # a socketpair's peer is this very process
    assert me is not None and me.pid == os.getpid() and not me.exited()
    assert DaemonProcess(os.getpid(), me.started + 1).exited()  # a reused pid
    child = subprocess.Popen(["sleep", "30"])
    try:
        with open(f"/proc/{child.pid}/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])
        proc = DaemonProcess(child.pid, started)
        assert not proc.exited()
        child.kill()
        deadline = time.monotonic() + 10
        while not proc.exited():  # a zombie until reaped: exited already
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert proc.exited()


def test_each_reclaimed_slot_comes_back_once() -> None:
    slots = ReadSlots(4)
    taken = [slots.take() for _ in range(4)]
    assert slots.take() is None
    slots.quarantine(None, 7, [taken[0], taken[1]])
    slots.give_back(taken[2])
    assert slots.circulating == 2 and slots.quarantined == 2
    assert slots.reclaim(lambda owner, session: False) == []
    back = slots.reclaim(lambda owner, session: session == 7)
    assert sorted(back) == sorted(taken[:2])
    assert slots.free == [taken[2]]  # the caller gives the reclaimed ones back, each once


@pytest.mark.filterwarnings("ignore:offloadd. lost the daemon:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:offloadd. write failed:RuntimeWarning")
def test_a_daemon_lost_right_after_the_handshake_is_not_made_current(
    own_daemon: Callable[..., DaemonProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reconnect whose daemon dies between the handshake and the step: that connection is
    not made the current one (its sender has ended: writes queued to it would wait forever for
    their slots); the step goes on without a daemon and the next one reconnects."""
    steps = 4
    reference = train(*MODELS["gpt"], None, steps=steps)
    d = own_daemon().start()
    off = small_offloader(d.dirs[0], daemon={"socket": d.socket})
    backend = off.runtime.backend
    assert backend is not None
    real_connect = backend._connect  # type: ignore[attr-defined]
    died: list[object] = []

    def connect_then_die() -> object:
        gen = real_connect()
        doomed.kill()
        deadline = time.monotonic() + 10
        while not gen.dead:
            assert time.monotonic() < deadline, "the client did not notice the loss"
            time.sleep(0.01)
        died.append(gen)
        monkeypatch.setattr(backend, "_connect", real_connect)
        own_daemon(dirs=d.dirs).start()  # for the step after
        return gen

    def between(step: int) -> None:
        nonlocal doomed
        if step == 0:
            d.kill()
            _wait_lost(off)
            doomed = own_daemon(dirs=d.dirs).start()
            monkeypatch.setattr(backend, "_connect", connect_then_die)
        elif step == 1:
            assert died and backend._current is not died[0]  # type: ignore[attr-defined]
        elif step == 2:
            assert backend.connected  # type: ignore[attr-defined]

    doomed = d
    result: list[list[list[torch.Tensor]]] = []
    worker = threading.Thread(
        target=lambda: result.append(_train(off, steps, between)), daemon=True
    )
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "training hung on a connection lost after its handshake"
    st = off.stats()
    off.close()
    assert result, "training raised (see the thread's exception above)"
    assert_bitwise_equal(reference, result[0])
    assert st.bytes_written > 0
