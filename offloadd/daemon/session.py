"""One client's state in the daemon: its shared memory, its offload files and its blocks.

Note: [per-session files] Each session gets its own unnamed file per offload directory, and
descriptors of them are passed to the client with the shared memory. A session therefore never
shares a file with another one: it cannot reach another session's bytes even with its own
descriptors, and when the daemon dies the client still holds its files and reads its blocks back
itself (the embedded fallback). When the client dies, the daemon closes the session's files and
the kernel frees the space at once: no name exists to leave behind.

The client's descriptors are open for reading only (:func:`read_only_descriptor`): the loss path
only reads, and a writable one would let a client write past its quota (see [quota per user]),
or over its blocks behind their checksums. They are new opens of the same files through
``/proc/self/fd`` (which works for unnamed O_TMPFILE files too), with O_DIRECT where the daemon's
own descriptor has it, so the client reads with the same alignment rules as before; and as
separate open file descriptions, a change of flags by the client (``fcntl(F_SETFL)``) no longer
reaches the daemon's. A client of the daemon's own uid could still reopen ``/proc/self/fd/N``
for writing (the files are 0600, the daemon's uid's); one of another uid cannot.

Note: [quota per user] ``quota_bytes`` bounds the disk bytes held by all sessions of one uid
together, not by each session: a client may open up to ``max_sessions`` sessions, so a bound per
session would bound nothing. The sessions of a uid share one :class:`Account`, charged when a
write gets its slot and credited when the slot is given back or the session's files are closed.

Note: [sessions per user] ``max_sessions`` bounds the sessions of one uid, counted in its
:class:`Account` (one more at OPEN, one less once the session is finished, its I/O done), not
the sessions of everyone together: a global cap let one allowed user open them all and lock
every other user out (EUSERS). Each session may have the daemon create up to ``max_shm_bytes``
of shared memory, so that memory is bounded per user as well: at most ``max_sessions`` times
``max_shm_bytes`` for each uid the daemon accepts (its own and ``allowed_uids``).

Note: [sealed memory] The daemon creates the shared memory as a memfd sealed against shrinking
and growing, so a client cannot truncate it under the daemon's mapping (which would kill the
daemon with SIGBUS). A reconnecting client may offer the memfd of its previous session instead
of getting a new one; the daemon accepts it only if it carries these seals and has a valid size.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
from dataclasses import dataclass, field

from offloadd.io.buffers import ALIGN
from offloadd.io.files import SlotFile

__all__ = [
    "Account",
    "Block",
    "Session",
    "SessionError",
    "check_memfd",
    "create_memfd",
    "read_only_descriptor",
]

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SessionError(Exception):
    """A refused request: ``errno`` goes back to the client in the reply."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.errno = code


def create_memfd(nbytes: int, name: str) -> int:
    """A sealed memfd of ``nbytes`` (see [sealed memory])."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_only_descriptor(f: SlotFile) -> int:
    """A new descriptor of ``f``'s file, open for reading only, with O_DIRECT as ``f`` has it,
    for the client (see [per-session files]). Raises OSError (no /proc, say)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if f.direct else 0)
    return os.open(f"/proc/self/fd/{f.fd}", flags)


def check_memfd(fd: int, low: int, high: int) -> int:
    """Size of a client-offered memfd, if it is sealed and ``low <= size <= high``."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("the offered descriptor is not a regular memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError("the offered descriptor is not a memfd") from None
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        raise ValueError("the offered memfd is not sealed against resizing")
    if not low <= st.st_size <= high or st.st_size % ALIGN:
        raise ValueError(f"the offered memfd has a bad size {st.st_size}")
    return st.st_size


@dataclass(slots=True)
class Block:
    """A chunk on disk: which of the session's files, where, and its checksum."""

    file: int
    offset: int
    nbytes: int
    checksum: int
    busy: int = 0  # engine requests using its disk slot
    freed: bool = False


@dataclass(slots=True)
class Account:
    """The sessions of one uid and the disk bytes they hold, against ``max_sessions`` and the
    quota (see [sessions per user], [quota per user])."""

    uid: int
    quota_bytes: int  # 0: none
    used_bytes: int = 0
    sessions: int = 0


@dataclass(slots=True)
class Session:
    """A connected client's session. All fields are touched on the event loop only."""

    id: int
    identity: str
    pid: int
    uid: int
    chunk_bytes: int
    shm_fd: int
    shm_bytes: int
    files: list[SlotFile]
    account: Account  # shared by the sessions of this uid
    blocks: dict[int, Block] = field(default_factory=dict)
    used_bytes: int = 0
    inflight: int = 0  # requests in the engine
    queued_reads: int = 0
    queued_writes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    errors: int = 0
    refused: int = 0
    closing: bool = False
    next_file: int = 0
    _mmap: mmap.mmap | None = None
    _window: ctypes.Array[ctypes.c_char] | None = None
    address: int = 0

    def map(self) -> None:
        self._mmap = mmap.mmap(self.shm_fd, self.shm_bytes, flags=mmap.MAP_SHARED)
        self._window = (ctypes.c_char * self.shm_bytes).from_buffer(self._mmap)
        self.address = ctypes.addressof(self._window)

    def view(self, offset: int, nbytes: int) -> memoryview:
        assert self._mmap is not None
        return memoryview(self._mmap)[offset : offset + nbytes]

    def check_range(self, offset: int, nbytes: int) -> None:
        """A chunk-sized, aligned range inside the shared memory, or SessionError(EINVAL)."""
        if (
            nbytes <= 0
            or nbytes > self.chunk_bytes
            or nbytes % ALIGN
            or offset % ALIGN
            or offset + nbytes > self.shm_bytes
        ):
            raise SessionError(
                errno.EINVAL,
                f"range offset={offset} nbytes={nbytes} is not an aligned chunk inside the "
                f"{self.shm_bytes}-byte shared memory (chunk {self.chunk_bytes})",
            )

    def alloc(self) -> tuple[int, int]:
        """A disk slot (file index, offset), striping over the files, within the quota of the
        session's uid (see [quota per user])."""
        acct = self.account
        if acct.quota_bytes and acct.used_bytes + self.chunk_bytes > acct.quota_bytes:
            raise SessionError(
                errno.EDQUOT,
                f"quota of {acct.quota_bytes} bytes per user exceeded: the {acct.sessions} "
                f"session(s) of uid {acct.uid} hold {acct.used_bytes} bytes (this one "
                f"{self.used_bytes}), a chunk is {self.chunk_bytes}",
            )
        i = self.next_file
        self.next_file = (i + 1) % len(self.files)
        self.used_bytes += self.chunk_bytes
        acct.used_bytes += self.chunk_bytes
        return i, self.files[i].alloc()

    def release(self, file: int, offset: int) -> None:
        self.files[file].free(offset)
        self.used_bytes -= self.chunk_bytes
        self.account.used_bytes -= self.chunk_bytes

    def close(self) -> None:
        """Close the files (the kernel frees their space) and the shared memory; the bytes
        they held are credited back to the account."""
        for f in self.files:
            f.close()
        self.files = []
        self.blocks.clear()
        self.account.used_bytes -= self.used_bytes
        self.used_bytes = 0
        self._window = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        if self.shm_fd >= 0:
            os.close(self.shm_fd)
            self.shm_fd = -1
