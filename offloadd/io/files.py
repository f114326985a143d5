"""Offload files: one unnamed file per directory, cut into fixed-size slots that are reused.

Note: [files leave nothing behind] Each file is opened with O_TMPFILE (or created and unlinked at
once where O_TMPFILE is refused), so it has no name: a crash, kill -9 included, leaves no file
and the kernel returns the space. Space is handed out in ``slot_bytes`` units from a free list
that prefers the lowest offsets, so a file grows to the most that was live at once and stays
there: it never grows with the length of the job. It is not shrunk while training: ftruncate
on an extent-mapped file costs milliseconds, and re-extending it costs more on the next step.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import psutil

from offloadd.io.buffers import ALIGN, AlignedBuffer, address_view

__all__ = [
    "MEMORY_FS",
    "DiskStore",
    "SlotFile",
    "default_offload_dir",
    "filesystem_type",
]

log = logging.getLogger("offloadd")

MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "shm", "overlay-tmpfs"})
"""File systems in memory: offloading there saves no memory, so no default directory is one."""


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """Type of the file system holding ``path`` (longest mount-point prefix), or ``""``."""
    real = os.path.realpath(path)
    best, kind = "", ""
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
            best, kind = mp, part.fstype
    return kind


def default_offload_dir(*, create: bool = True) -> str:
    """A per-user directory on local disk (never tmpfs), created if needed. ``create=False``:
    the one that would be chosen, nothing created (a missing candidate counts if the nearest
    directory above it that exists is writable)."""
    uid = os.getuid()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    candidates = [
        os.path.join(xdg, "offloadd"),
        f"/var/tmp/offloadd-{uid}",
        f"/tmp/offloadd-{uid}",
    ]
    for cand in candidates:
        probe = cand
        try:
            if create:
                os.makedirs(cand, mode=0o700, exist_ok=True)
            elif os.path.lexists(cand) and not os.path.isdir(cand):
                continue  # makedirs would refuse it
            else:
                while not os.path.lexists(probe) and probe != os.path.dirname(probe):
                    probe = os.path.dirname(probe)
        except OSError:
            continue
        if os.access(probe, os.W_OK) and filesystem_type(probe) not in MEMORY_FS:
            if create:
                log.info("offloadd: no ssd_dirs given; offloading to %s", cand)
            return cand
    raise ValueError(
        "ssd_dirs: no directory given and none of "
        + ", ".join(candidates)
        + " is writable local disk; set ssd_dirs (OFFLOADD_SSD_DIRS)"
    )


def _check_dir(d: str) -> None:
    p = Path(d)
    if not p.exists():
        raise ValueError(f"ssd_dirs: directory {d!r} does not exist")
    if not p.is_dir():
        raise ValueError(f"ssd_dirs: {d!r} is not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"ssd_dirs: directory {d!r} is not writable")


class SlotFile:
    """One unnamed file in ``directory`` whose space is handed out ``slot_bytes`` at a time."""

    def __init__(self, directory: str, slot_bytes: int, direct_io: str) -> None:
        _check_dir(directory)
        self.directory = directory
        self.path = os.path.join(directory, f"offloadd-{os.getpid()}-{secrets.token_hex(4)}.blk")
        self.slot_bytes = slot_bytes
        self.direct = direct_io != "off"
        self.fd = self._open(direct_io)
        self._free: set[int] = set()  # free slot indices below _end
        self._heap: list[int] = []  # the same indices (and stale ones), lowest first
        self._end = 0
        self.used_slots = 0

    def _open(self, direct_io: str) -> int:
        base = os.O_RDWR | os.O_CLOEXEC
        flags = base | (os.O_DIRECT if self.direct else 0)
        try:
            fd = self._create(flags)
        except OSError as e:
            if e.errno == errno.EINVAL and self.direct and direct_io == "auto":
                log.warning("offloadd: %s refuses O_DIRECT; using buffered I/O", self.directory)
                self.direct = False
                fd = self._create(base)
            else:
                raise ValueError(
                    f"ssd_dirs: cannot create a file in {self.directory!r}: {e}"
                ) from e
        if self.direct:
            fd = self._probe_direct(fd, direct_io)
        return fd

    def _create(self, flags: int) -> int:
        tmpfile = getattr(os, "O_TMPFILE", 0)
        if tmpfile:
            try:
                return os.open(self.directory, flags | tmpfile, 0o600)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
        fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(self.path)
        return fd

    def _probe_direct(self, fd: int, direct_io: str) -> int:
        """Write and read one aligned page: some file systems accept O_DIRECT at open only."""
        buf = AlignedBuffer(ALIGN)
        try:
            os.pwrite(fd, address_view(buf.address, ALIGN), 0)
            os.ftruncate(fd, 0)
            return fd
        except OSError as e:
            if e.errno != errno.EINVAL or direct_io != "auto":
                os.close(fd)
                raise ValueError(f"ssd_dirs: cannot write to {self.directory!r}: {e}") from e
            log.warning("offloadd: %s refuses O_DIRECT writes; using buffered I/O", self.directory)
            os.close(fd)
            self.direct = False
            return self._create(os.O_RDWR | os.O_CLOEXEC)
        finally:
            buf.close()

    def alloc(self) -> int:
        """Offset of a free slot, the lowest one first."""
        self.used_slots += 1
        while self._heap:
            i = heapq.heappop(self._heap)
            if i in self._free:  # entries dropped by a shrink are skipped
                self._free.discard(i)
                return i * self.slot_bytes
        self._end += 1
        return (self._end - 1) * self.slot_bytes

    def free(self, offset: int) -> None:
        """Return a slot for reuse (the lowest free slots are handed out first)."""
        self.used_slots -= 1
        i = offset // self.slot_bytes
        self._free.add(i)
        heapq.heappush(self._heap, i)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DiskStore:
    """The offload files of all ``dirs``; chunk ``k`` of a block goes to file ``(first + k) % n``."""

    def __init__(self, dirs: Sequence[str], slot_bytes: int, direct_io: str) -> None:
        self.files: list[SlotFile] = []
        try:
            for d in dirs:
                self.files.append(SlotFile(d, slot_bytes, direct_io))
        except BaseException:
            self.close()
            raise
        self.slot_bytes = slot_bytes

    @property
    def buffered(self) -> bool:
        return any(not f.direct for f in self.files)

    @property
    def used_bytes(self) -> int:
        return sum(f.used_slots for f in self.files) * self.slot_bytes

    def close(self) -> None:
        for f in self.files:
            f.close()
