"""Whether a shape's blocks now run at another speed than when it was planned: the planner's cue
to profile it again (Note [auto] in planner.py).

A shape's reference is the summed block forward time of its second planned step (the first warms
caches to the plan's allocations, and on small blocks runs several times slower than later ones:
docs/benchmarks/auto-paired_rok-models_cpu-2core_2026-11-27.md). A planned
step off the reference by more than ``DRIFT`` either way, ``DRIFT_STEPS`` steps in a row, is
drift. CPU only: on CUDA forward times are the host's, which runs ahead of the device.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DRIFT", "DRIFT_STEPS", "Drift"]

DRIFT = 2.0  # block forward time off the reference step's by this factor (either way) ...
DRIFT_STEPS = 3  # ... this many planned steps in a row: profile again


class Drift:
    """Each shape's reference forward time, and the planned steps off it in a row."""

    def __init__(self) -> None:
        self.reference: dict[tuple[Any, ...], float | None] = {}
        self._off = 0

    def forget(self, sig: tuple[Any, ...]) -> None:
        """A new plan for ``sig``: its next planned step warms up, the one after is the
        reference."""
        self.reference.pop(sig, None)

    def step(self, sig: tuple[Any, ...], fwd_s: float) -> float | None:
        """A planned step of ``sig`` ran its blocks' forwards in ``fwd_s`` seconds: the ratio
        to the reference once it drifted (and the reference is forgotten), else None."""
        if sig not in self.reference:
            self.reference[sig] = None  # the first planned step: not a reference
            return None
        ref = self.reference[sig]
        if ref is None:
            self.reference[sig] = ref = fwd_s
        ratio = fwd_s / ref
        self._off = self._off + 1 if not 1 / DRIFT < ratio < DRIFT else 0
        if self._off < DRIFT_STEPS:
            return None
        self._off = 0
        del self.reference[sig]
        return ratio
