"""The search for a strategy's wall: the largest size (batch or sequence length) that trains.

Doubling from ``start`` until a point fails, then bisection between the largest that trained and
the smallest that did not, until they are ``tolerance`` apart: about ``2 log2(wall / start)``
points. Memory grows with the size, so one size that fails for memory (``MEMORY``: out of
memory, or auto's planner finding no plan within its budget) stands for every larger one; a point
that fails for another reason (status ``error``) ends the search there, reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["MEMORY", "Wall", "find_wall"]

MEMORY = frozenset({"oom", "infeasible"})
"""The statuses of a size that does not fit."""


@dataclass(slots=True)
class Wall:
    """What the search found: ``largest`` that trained (None: not even ``start``),
    ``smallest_failed`` (None: nothing failed up to the search's ``most``), and every point
    tried, in order, with its status."""

    largest: int | None = None
    smallest_failed: int | None = None
    failed_as: str | None = None  # the status of smallest_failed (oom, infeasible, error)
    tried: list[tuple[int, str]] = field(default_factory=list)


def find_wall(status_of: Callable[[int], str], start: int, most: int, tolerance: int = 1) -> Wall:
    """Search sizes ``start`` .. ``most`` with ``status_of(size)`` ("ok" if it trained)."""
    if not 1 <= start <= most:
        raise ValueError(f"need 1 <= start <= most, got start {start}, most {most}")
    if tolerance < 1:
        raise ValueError(f"tolerance must be 1 or more, got {tolerance}")
    wall = Wall()

    def tried(size: int) -> bool:
        status = status_of(size)
        wall.tried.append((size, status))
        if status == "ok":
            wall.largest = size
            return True
        wall.smallest_failed, wall.failed_as = size, status
        return False

    size = start
    while tried(size):  # doubling
        if size >= most:
            return wall
        size = min(2 * size, most)
    if wall.failed_as not in MEMORY:
        return wall  # not memory: the search cannot go on from it
    while True:
        lo, hi = wall.largest, wall.smallest_failed
        if lo is None or hi is None or hi - lo <= tolerance:
            return wall
        if not tried((lo + hi) // 2) and wall.failed_as not in MEMORY:
            return wall
