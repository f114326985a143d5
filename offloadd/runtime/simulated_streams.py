"""Streams and events of the simulated device (see simulated.py).

A :class:`SimulatedStream` is an ordered queue of work run by one worker thread. Each item
completes no earlier than a random delay after it was queued, and after the items queued before
it: CUDA's guarantee for a stream, and nothing more. A stream with a lag holds every item of
work back ``lag_s`` longer, unless someone waits for an event recorded at or after it: its work
then runs as late as anything allows, so a reader that forgot to wait finds it not done, every
time, and the lag only bounds how long a poller (``Event.query``) can be kept waiting. An event
completes as soon as the work before it has.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["SimulatedEvent", "SimulatedStream"]


class SimulatedStream:
    """An ordered queue of work on one worker thread (see the module's docstring).

    ``host_runs``: a compute stream, whose kernels the threads that use it run themselves (CPU
    ops); only the work the simulation queues on it (events, waits, its own copies, the checks
    of kernels' reads) goes through the worker."""

    def __init__(
        self,
        name: str,
        delay: Callable[[], float],
        lag_s: float,
        on_error: Callable[[str], None],
        *,
        host_runs: bool = False,
    ) -> None:
        self.name = name
        self.host_runs = host_runs
        self._delay = delay
        self._lag_s = lag_s
        self._on_error = on_error
        self._cond = threading.Condition()
        self._items: deque[tuple[int, float, Callable[[], None] | None]] = deque()
        self._queued = 0  # items queued so far; an item is known by its number, from 1
        self._done = 0  # items completed (they complete in order)
        self._forced = 0  # items up to this number run without the lag: someone waits for them
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"offloadd-sim-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<stream {self.name}>"

    def put(self, work: Callable[[], None] | None) -> int:
        """Queue ``work`` (None: nothing, an event's place); returns the item's number."""
        delay = self._delay()
        due = time.monotonic() + delay
        with self._cond:
            self._queued += 1
            if work is None and delay <= 0 and self._done == self._queued - 1:
                self._done = self._queued  # an event on an idle stream: complete at once
                self._cond.notify_all()
                return self._queued
            self._items.append((self._queued, due, work))
            self._cond.notify_all()
            return self._queued

    def record(self) -> SimulatedEvent:
        """An event that completes once the work queued so far has."""
        return SimulatedEvent(self, self.put(None))

    def reached(self, n: int) -> bool:
        return self._done >= n

    def run_through(self, n: int) -> None:
        """Wait until item ``n`` completed; the items up to it lose their lag."""
        with self._cond:
            if self._forced < n:
                self._forced = n
                self._cond.notify_all()
            while self._done < n:
                self._cond.wait()

    def close(self) -> None:
        """Run what is queued, without lags, then stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _next(self) -> tuple[int, Callable[[], None] | None] | None:
        """The next item once it is due (None: closed and drained)."""
        with self._cond:
            while True:
                if self._items:
                    n, due, work = self._items[0]
                    if work is not None and n > self._forced and not self._closing:
                        due += self._lag_s  # an event's place has no work to hold back
                    left = due - time.monotonic()
                    if left <= 0:
                        self._items.popleft()
                        return n, work
                    self._cond.wait(left)
                elif self._closing:
                    return None
                else:
                    self._cond.wait()

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            n, work = item
            if work is not None:
                try:
                    work()
                except BaseException as e:  # the stream goes on, as a device would
                    self._on_error(f"work on {self.name} failed: {e!r}")
            del work, item
            with self._cond:
                self._done = n
                self._cond.notify_all()


class SimulatedEvent:
    """An event recorded on a :class:`SimulatedStream`: complete once its item is."""

    __slots__ = ("n", "stream")

    def __init__(self, stream: SimulatedStream, n: int) -> None:
        self.stream = stream
        self.n = n

    def query(self) -> bool:
        return self.stream.reached(self.n)

    def synchronize(self) -> None:
        self.stream.run_through(self.n)
