"""Saying so when the training thread has waited long for I/O: a stopped daemon or a hung disk
shows up in the log instead of as a silent hang."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["STALL_WARN_S", "StallWatch"]

log = logging.getLogger("offloadd")

STALL_WARN_S = 30.0
"""A wait of the training thread for I/O this long is logged at WARNING, and again each time it
has doubled: a stopped daemon or a hung disk shows up in the log instead of as a silent hang."""


class StallWatch:
    """Logs a wait that has gone on for :data:`STALL_WARN_S`, then 2x, 4x... as long: how long,
    for what, and ``hint()`` (what the backend knows: which engine or daemon, and its state)."""

    def __init__(self, what: str, hint: Callable[[], str]) -> None:
        self.what, self.hint = what, hint
        self.start = time.monotonic()
        self.next = self.start + STALL_WARN_S

    def timeout(self, most: float = 1.0) -> float:
        """How long the next wait may block before :meth:`check` is due."""
        return max(0.001, min(most, self.next - time.monotonic()))

    def check(self) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        waited = now - self.start
        self.next = self.start + 2 * waited
        try:
            hint = self.hint()
        except Exception as e:  # a hint must never turn a slow wait into a failure
            hint = f"(its state could not be read: {e})"
        log.warning(
            "offloadd: the training thread has waited %.0f s for %s, and still waits; I/O by %s",
            waited,
            self.what,
            hint,
        )
