"""The runtime's accounts: its one lock, its counters, and the warnings raised outside the lock.

Every part of the runtime (pack and unpack, the write path, the read path, I/O callbacks) shares
one :class:`Ledger`: its ``lock`` guards all block state, its ``cond`` is notified whenever a
write or read completes or a capture settles, and its :class:`~offloadd.Stats` are the counters
that ``Offloader.stats()`` snapshots. It also trims the C heap as CPU activations move
(heap_trim.py), and its waits say when they take long (stall_watch.py).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from collections.abc import Callable

from offloadd.runtime.heap_trim import malloc_trim
from offloadd.runtime.stall_watch import StallWatch
from offloadd.runtime.stats import Stats

__all__ = ["Ledger"]

log = logging.getLogger("offloadd")


class Ledger:
    """The lock, the stats, resident/disk accounting, deferred warnings and heap trimming."""

    def __init__(self, trim_host_bytes: int) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.stats = Stats()
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()  # warn_once runs on I/O threads too, lock or not
        self._warnings: deque[str] = deque()  # raised by flush_warnings, outside the lock
        self._trim_every = trim_host_bytes
        self._trim = malloc_trim() if trim_host_bytes else None
        self._moved_since_trim = 0  # CPU bytes moved out or in since the last trim
        self.window_peak = 0  # most resident + buffer bytes since the planner last reset it
        self.kept_now = 0  # resident bytes that are kept as saved (not in flight nor read back)
        self.kept_peak = 0  # most kept_now since the planner last reset it
        self.tally_now = 0  # the tally's resident bytes as last applied (see [the tally])

    # -- accounting (lock held) ------------------------------------------------------------

    def add_resident(self, n: int, *, kept: bool = False) -> None:
        if kept:
            self.kept_now += n
            if self.kept_now > self.kept_peak:
                self.kept_peak = self.kept_now
        st = self.stats
        st.resident_bytes += n
        if st.resident_bytes > st.peak_resident_bytes:
            st.peak_resident_bytes = st.resident_bytes
        held = st.resident_bytes + st.buffer_bytes
        if held > self.window_peak:
            self.window_peak = held

    def apply_kept(self, saved: int, saved_bytes: int, dedup: int, now: int, peak: int) -> None:
        """What ``Tally.take`` returned: tensors saved and kept since (and their bytes shared
        with an earlier save), the tally's resident bytes now, and the most it held since (see
        [the tally] in held.py)."""
        st = self.stats
        st.saved_tensors += saved
        st.saved_bytes += saved_bytes
        st.kept_bytes += saved_bytes - dedup
        st.deduplicated_bytes += dedup
        rise = peak - self.tally_now
        if rise > 0:  # the high, at which the peaks are noted, then down to now
            self.add_resident(rise, kept=True)
            self.sub_resident(peak - now, kept=True)
        else:
            self.sub_resident(self.tally_now - now, kept=True)
        self.tally_now = now

    def sub_resident(self, n: int, *, kept: bool = False) -> None:
        if kept:
            self.kept_now -= n
        self.stats.resident_bytes -= n

    def note_disk(self, used: int) -> None:
        st = self.stats
        st.disk_bytes = used
        if used > st.peak_disk_bytes:
            st.peak_disk_bytes = used

    def note_buffers(self, mapped: int) -> None:
        st = self.stats
        st.buffer_bytes = mapped
        if mapped + st.resident_bytes > self.window_peak:
            self.window_peak = mapped + st.resident_bytes
        if mapped > st.peak_buffer_bytes:
            st.peak_buffer_bytes = mapped

    def note_moved(self, nbytes: int) -> None:
        """Trim the C heap once per ``trim_host_bytes`` of CPU activations moved (see config)."""
        if self._trim is None:
            return
        self._moved_since_trim += nbytes
        if self._moved_since_trim >= self._trim_every:
            self._moved_since_trim = 0
            self._trim(0)

    # -- warnings --------------------------------------------------------------------------

    def warn_once(self, key: str, message: str) -> None:
        """Log now; raise the Python warning later on the training thread, outside the lock
        (I/O callbacks call this, and warnings may be configured to raise). Callers may or may
        not hold ``lock`` (the daemon client's threads do not): its own lock."""
        with self._warn_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message)
        self._warnings.append(message)

    @property
    def warnings_due(self) -> bool:
        return bool(self._warnings)

    def wait_while(self, busy: Callable[[], bool], what: str, hint: Callable[[], str]) -> None:
        """Wait (``lock`` held) on ``cond`` while ``busy()``, saying so if it takes long (see
        :class:`StallWatch`)."""
        if not busy():
            return
        watch = StallWatch(what, hint)
        while busy():
            self.cond.wait(timeout=watch.timeout())
            watch.check()

    def flush_warnings(self) -> None:
        """Raise the queued warnings (the caller does not hold ``lock``)."""
        while self._warnings:
            warnings.warn(self._warnings.popleft(), RuntimeWarning, stacklevel=4)
