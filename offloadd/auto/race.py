"""Racing the plan against offloading every block, in real training steps.

Note: [race] The profile prices an offloaded block at the I/O wait measured for it. That is not
offloading's whole cost, nor always a cost at all: on a 2-core VM the disk traffic slows the
compute around it (the hypervisor's steal rises), which no wait shows, and where the allocator
keeps freed activations warm, offloading can make a step faster than keeping them (the steady
issue: auto's plan k3 o6 ran at 0.93x offloading every block, which also held less). So after
the first plan for a shape, the planner races it against offloading every block (the leanest of
the plans that offload; where it does not fit the budget, or is the plan, there is no race) over
``RACE_STEPS`` steps each, in the order A B B A A B so that a drift in the machine's speed falls
on both alike, and compares the medians of their step times. A raced step is timed from its
forward's start to the gradient of the first block's input, that is forward and backward but not
the optimizer or data loading, which do not depend on the plan and which gradient accumulation
would put in one micro-batch out of several (without such a gradient, or compiled: to the next
forward's start). The first step of the plan also pays for planning and for caches warming to
its allocations; the median of three leaves one such step out.

- Offloading every block within ``NOISE`` of the plan's time, or faster: offloading is taken to
  cost nothing here, and of plans as fast as the fastest, the one holding the least memory is the
  one to run: offload every block (the issue's rule; also at a budget where keeping all fits).
- Slower by more than that: the race measured what offloading costs per byte,

      alpha = (T_all - T_plan + R_plan) / (O_all - O_plan)

  (T: median step times; R: the plan's recompute time, the recomputed blocks' forward times; O:
  bytes offloaded a step), and the planner plans again with every offloaded block costing
  ``alpha x`` its saved bytes instead of its I/O wait. Replans after a step over budget use it
  too.

One race runs at a time: a shape planned while another races waits for it, and a race whose
shape has not come back for ``PATIENCE`` forwards (a shape that was rare) is put back to wait
too. A replan of the racing shape (a step over budget) restarts its race with the new plan. Both
contenders fit the budget, and the budget's check goes on for every step measured (on CPU every
one; on CUDA the first under each plan, and offloading every block, the leanest, is not measured
again). On CUDA a raced step synchronizes the device at its start and at its end.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from offloadd.auto.solver import OFFLOAD, RECOMPUTE, BlockCost, Plan

__all__ = ["NOISE", "ORDER", "PATIENCE", "RACE_STEPS", "Race", "Verdict", "decide", "priced"]

RACE_STEPS = 3
"""Steps each plan runs in a race."""
NOISE = 0.02
"""Offloading every block within this fraction of the plan's step time counts as free."""
ORDER = (0, 1, 1, 0, 0, 1)
"""Which plan each raced step runs: 0 the planner's, 1 offloading every block (``RACE_STEPS``
each)."""
PATIENCE = 4 * len(ORDER)
"""Forwards of other shapes a race waits for its own before it gives way."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a race measured: median step times, and offloading's cost per byte."""

    plan_s: float
    all_s: float
    alpha: float
    """Seconds per byte offloaded (may be zero or negative)."""
    free: bool
    """Offloading every block was within ``NOISE`` of the plan, or faster."""

    def __str__(self) -> str:
        ratio = self.all_s / self.plan_s if self.plan_s > 0 else float("nan")
        how = (
            "offloading is free here: offloading every block, the least memory"
            if self.free
            else f"offloading costs {self.alpha * 2**30 * 1e3:.1f} ms per GiB here: planning "
            "with that"
        )
        return (
            f"{self.plan_s:.3f} s a step for the plan, {self.all_s:.3f} s offloading every block "
            f"({ratio:.2f}x): {how}"
        )


def priced(costs: list[BlockCost], verdict: Verdict | None) -> list[BlockCost]:
    """``costs`` with each offloaded block priced at what the race measured (a cost, not a gain:
    where offloading is free or faster, :func:`decide` takes offloading every block instead)."""
    if verdict is None or verdict.free or verdict.alpha <= 0:
        return costs  # alpha <= 0 and not free: nothing more offloaded to price it by
    return [dataclasses.replace(b, offload_s=max(0.0, verdict.alpha) * b.saved) for b in costs]


def decide(plan: Plan, every: Plan | None, verdict: Verdict | None) -> Plan:
    """The plan to run after a race: offloading every block (``every``, None where it does not
    fit) if the race found offloading free, else the solver's ``plan`` priced by :func:`priced`;
    before any race, ``plan``."""
    if verdict is None:
        return plan
    chosen = every if verdict.free and every is not None else plan
    return dataclasses.replace(chosen, race=(verdict.plan_s, verdict.all_s))


@dataclass(slots=True)
class Race:
    """The race for one input shape (``signature``): the planner's plan against offloading every
    block (see [race])."""

    signature: tuple[Any, ...]
    plans: tuple[Plan, Plan]
    times: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    turn: int = 0
    running: int | None = None
    """The plan the step now running was given (None: not a raced step)."""
    started: float = 0.0
    ended: float | None = None  # the running step's backward reached the first block's input
    others: int = 0  # forwards of other shapes since its own last ran

    def begin(self, t0: float) -> Plan:
        """A step of this shape, begun at ``t0``, runs the plan whose turn it is."""
        self.running = ORDER[self.turn]
        self.turn += 1
        self.started = t0
        self.ended = None
        self.others = 0
        return self.plans[self.running]

    def mark(self, t: float) -> None:
        """The running step's backward reached the first block's input at ``t``."""
        if self.running is not None and self.ended is None:
            self.ended = t

    def end(self, t1: float) -> None:
        """The next forward starts at ``t1``: the running step's time is taken."""
        if self.running is not None:
            stop = self.ended if self.ended is not None else t1
            self.times[self.running].append(stop - self.started)
            self.running = None

    @property
    def done(self) -> bool:
        return self.turn >= len(ORDER) and self.running is None

    def verdict(self) -> Verdict:
        plan, every = self.plans
        t_plan = statistics.median(self.times[0])
        t_all = statistics.median(self.times[1])
        moved = offloaded_bytes(every) - offloaded_bytes(plan)
        recomputed = sum(
            b.forward_s for b, d in zip(plan.blocks, plan.decisions, strict=True) if d == RECOMPUTE
        )
        alpha = (t_all - t_plan + recomputed) / moved if moved > 0 else 0.0
        return Verdict(t_plan, t_all, alpha, free=t_all <= t_plan * (1 + NOISE))


def offloaded_bytes(plan: Plan) -> int:
    """What ``plan`` offloads a step: the saved bytes of its offloaded units."""
    return sum(b.saved for b, d in zip(plan.blocks, plan.decisions, strict=True) if d == OFFLOAD)
