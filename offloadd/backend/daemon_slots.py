"""The daemon client's read slots, and the ones a lost daemon may still write into.

Note: [read slots after a loss] A read is answered by the daemon writing the chunk into a read
slot of the session's shared memory, from which the client copies it out. When the connection
is lost while reads are in flight, the daemon process may still be alive: it dropped the client
(a protocol error, a client that did not read), or it is stopping and finishes its sessions'
I/O first (``offloadd stop``, then a new ``offloadd serve`` at once), or it was stopped and is
continued. Such a daemon completes those reads later, into the same pages, and the client's next
session offers the same memfd (the staging slots live there too). So the slots of the reads in
flight at a loss are *quarantined*: they leave circulation, tagged with the daemon's process
(its pid from SO_PEERCRED and its start time, which tells a reused pid apart), and come back
only once that process has exited, checked at each step's reconnect. While every slot is
quarantined, reads go to the session's files directly (as after a loss: the descriptors the
daemon passed at open, checksum verified), so no read waits for a slot that cannot come back.
A daemon whose process cannot be identified (another pid namespace) keeps its slots for good.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import psutil

from offloadd.daemon.trust import peer_credentials

__all__ = ["DaemonProcess", "ReadSlots"]


@dataclass(frozen=True, slots=True)
class DaemonProcess:
    """The process at the other end of a session's socket."""

    pid: int
    started: float  # its start time (psutil): a pid reused by another process differs here

    @classmethod
    def of(cls, sock: socket.socket) -> DaemonProcess | None:
        """The peer of ``sock`` (SO_PEERCRED), or None where it cannot be identified."""
        try:
            pid = peer_credentials(sock)[0]
            if pid <= 0:  # a peer in a pid namespace we cannot see
                return None
            return cls(pid, psutil.Process(pid).create_time())
        except (OSError, AttributeError, psutil.Error):
            return None

    def exited(self) -> bool:
        """Whether the process is gone (a zombie writes no memory); False if unsure."""
        try:
            p = psutil.Process(self.pid)
            return p.create_time() != self.started or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False


class ReadSlots:
    """Free read slots, and quarantined ones (see [read slots after a loss]); the backend's
    lock is held for every call."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: list[tuple[DaemonProcess | None, list[int]]] = []

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def quarantined(self) -> int:
        return sum(len(slots) for _owner, slots in self._held)

    @property
    def circulating(self) -> int:
        """Slots that are free or carry a read of the current session: each comes back."""
        return self.num_slots - self.quarantined

    def quarantine(self, owner: DaemonProcess | None, slots: list[int]) -> None:
        """Take ``slots`` out of circulation until ``owner`` has exited."""
        if slots:
            self._held.append((owner, slots))

    def reclaim(self) -> list[int]:
        """Bring back the slots of daemons that have exited; returns them (already free)."""
        back: list[int] = []
        still: list[tuple[DaemonProcess | None, list[int]]] = []
        for owner, slots in self._held:
            if owner is not None and owner.exited():
                back.extend(slots)
            else:
                still.append((owner, slots))
        self._held = still
        self._free.extend(back)
        return back
