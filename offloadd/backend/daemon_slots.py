"""The daemon client's read slots, and the ones a lost daemon may still write into.

Note: [read slots after a loss] A read is answered by the daemon writing the chunk into a read
slot of the session's shared memory, from which the client copies it out. When the connection
is lost while reads are in flight, the daemon process may still be alive: it dropped the client
(a protocol error, a client that did not read), or it is stopping and finishes its sessions'
I/O first (``offloadd stop``, then a new ``offloadd serve`` at once), or it was stopped and is
continued. Such a daemon completes those reads later, into the same pages, and the client's next
session offers the same memfd (the staging slots live there too). So the slots of the reads in
flight at a loss are *quarantined*: they leave circulation, tagged with the lost session's
number and the daemon's process, and come back, at a step's start, once either

* that process has exited: its pid (SO_PEERCRED) no longer names a live process started at the
  same clock tick (``/proc/<pid>/stat``'s start time, counted from boot, so that neither a pid
  reused by another process nor a step of the wall clock is taken for it); or
* the client is connected to that same process again and the lost session is no longer among
  its sessions (STATS): the daemon ends a dropped session only once its I/O is done.

Each slot comes back once, to a waiting read or to the free list. While every slot is
quarantined, reads go to the session's files directly (as after a loss: the descriptors the
daemon passed at open, checksum verified), so no read waits for a slot that cannot come back;
that is logged once. A daemon whose process cannot be identified (another pid namespace) keeps
its slots for good.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

from offloadd.wire.trust import peer_credentials

__all__ = ["DaemonProcess", "ReadSlots"]


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rindex(b")") + 2 :].decode().split()


@dataclass(frozen=True, slots=True)
class DaemonProcess:
    """The process at the other end of a session's socket."""

    pid: int
    started: int  # its start time in clock ticks since boot: tells a reused pid apart

    @classmethod
    def of(cls, sock: socket.socket) -> DaemonProcess | None:
        """The peer of ``sock`` (SO_PEERCRED), or None where it cannot be identified."""
        try:
            pid = peer_credentials(sock)[0]
        except (OSError, AttributeError):  # no SO_PEERCRED off Linux
            return None
        fields = _stat_fields(pid) if pid > 0 else None  # 0: a pid namespace we cannot see
        return None if fields is None else cls(pid, int(fields[19]))

    def exited(self) -> bool:
        """Whether the process is gone (a zombie writes no memory)."""
        fields = _stat_fields(self.pid)
        return fields is None or fields[0] in ("Z", "X") or int(fields[19]) != self.started


class ReadSlots:
    """Free read slots, and quarantined ones (see [read slots after a loss]); the backend's
    lock is held for every call."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: list[tuple[DaemonProcess | None, int, list[int]]] = []

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free(self) -> list[int]:
        return list(self._free)

    @property
    def quarantined(self) -> int:
        return sum(len(slots) for _owner, _session, slots in self._held)

    @property
    def circulating(self) -> int:
        """Slots that are free or carry a read of the current session: each comes back."""
        return self.num_slots - self.quarantined

    def owners(self) -> set[tuple[DaemonProcess | None, int]]:
        """(daemon process, lost session) of each quarantine."""
        return {(owner, session) for owner, session, _slots in self._held}

    def quarantine(self, owner: DaemonProcess | None, session: int, slots: list[int]) -> None:
        """Take ``slots`` out of circulation: the lost ``session`` of ``owner`` may fill them."""
        if slots:
            self._held.append((owner, session, slots))

    def reclaim(self, done: Callable[[DaemonProcess | None, int], bool]) -> list[int]:
        """End the quarantines that ``done(owner, session)`` says are over; returns their slots,
        which the caller gives back, each once (to a waiting read or :meth:`give_back`)."""
        back: list[int] = []
        still: list[tuple[DaemonProcess | None, int, list[int]]] = []
        for owner, session, slots in self._held:
            if done(owner, session):
                back.extend(slots)
            else:
                still.append((owner, session, slots))
        self._held = still
        return back
