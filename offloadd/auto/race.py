"""Racing the plan against offloading every block, in real training steps.

Note: [race] The profile prices an offloaded block at the I/O wait measured for it. That is not
offloading's whole cost, nor always a cost at all: on a virtual machine with few cores the disk
traffic slows the compute around it (the hypervisor's steal rises), which no wait shows, and
where the allocator keeps freed activations warm, offloading can make a step faster than keeping
them (a plan that kept blocks has run slower than offloading every block, which also held less:
docs/benchmarks/rok-race_hf-gpt2_cpu-2core_2026-11-26.md). So after
the first plan for a shape, the planner races it against offloading every block (the leanest of
the plans that offload; where it does not fit the budget, or is the plan, there is no race) over
as many steps as it takes to tell them apart (below). A raced step is timed from its
forward's start to the gradient of the first block's input, that is forward and backward but not
the optimizer or data loading, which do not depend on the plan and which gradient accumulation
would put in one micro-batch out of several (without such a gradient, or compiled: to the next
forward's start).

The race runs in blocks of four steps, A B B A (A the plan, B offloading every block), so that a
linear drift in the machine's speed falls on both alike; each block gives one paired figure, the
log of B's two steps over A's. The first block is not counted: each plan's first step also pays
for planning and for caches warming to its allocations. After ``MIN_BLOCKS`` counted blocks, and
after each one more, the race looks at the 95 % interval of the mean of those figures (Student's
t): offloading every block costs more than ``NOISE`` (the interval lies above it) or not (the
interval lies below it), or the race runs another block, up to ``MAX_BLOCKS``. Steps of one
process vary by a few per cent on a shared virtual machine, so a fixed, small number of steps a
side can pick the slower contender (docs/benchmarks/README.md#the-budget-planner).

- Offloading every block within ``NOISE`` of the plan's time, or faster, or not shown slower by
  more than that in ``MAX_BLOCKS`` blocks: offloading is taken to cost nothing here, and of plans
  as fast as the fastest, the one holding the least memory is the one to run: offload every block
  (also at a budget where keeping all fits).
- Slower by more than that: the race measured what offloading costs per byte,

      alpha = (T_all - T_plan + R_plan) / (O_all - O_plan)

  (T_plan: the median of the plan's counted steps, T_all: T_plan times the paired ratio; R: the
  plan's recompute time, the recomputed blocks' forward times; O: bytes offloaded a step), and
  the planner plans again with every offloaded block costing ``alpha x`` its saved bytes instead
  of its I/O wait. Replans after a step over budget use it too.

One race runs at a time: a shape planned while another races waits for it, and a race whose
shape has not come back for ``PATIENCE`` forwards (a shape that was rare) is put back to wait
too. A replan of the racing shape (a step over budget) restarts its race with the new plan. Both
contenders fit the budget, and the budget's check goes on for every step measured (on CPU every
one; on CUDA the first under each plan, and offloading every block, the leanest, is not measured
again). On CUDA a raced step synchronizes the device at its start and at its end.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from offloadd.auto.solver import OFFLOAD, RECOMPUTE, BlockCost, Plan, RaceTimes

__all__ = [
    "BLOCK",
    "MAX_BLOCKS",
    "MIN_BLOCKS",
    "NOISE",
    "PATIENCE",
    "RACE_STEPS_MAX",
    "RACE_STEPS_MIN",
    "Race",
    "Verdict",
    "decide",
    "priced",
]

BLOCK = (0, 1, 1, 0)
"""Which plan each step of a block runs: 0 the planner's, 1 offloading every block."""
WARM_BLOCKS = 1
"""Blocks run first and not counted (each plan's first step warms caches to it)."""
MIN_BLOCKS = 3
"""Counted blocks before a verdict."""
MAX_BLOCKS = 8
"""Counted blocks at most: not told apart by then, the two are within the noise."""
RACE_STEPS_MIN = len(BLOCK) * (WARM_BLOCKS + MIN_BLOCKS)
"""Steps of the shortest race."""
RACE_STEPS_MAX = len(BLOCK) * (WARM_BLOCKS + MAX_BLOCKS)
"""Steps of the longest race."""
NOISE = 0.02
"""Offloading every block within this fraction of the plan's step time counts as free."""
PATIENCE = 24
"""Forwards of other shapes a race waits for its own before it gives way."""
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)
"""Student's t, two-sided 95 %, for 1 to 9 degrees of freedom."""
assert len(_T95) >= MAX_BLOCKS - 1


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a race measured: step times, the paired ratio, and offloading's cost per byte."""

    plan_s: float
    """The median of the plan's counted steps."""
    all_s: float
    """``plan_s`` times the paired ratio: offloading every block's step time."""
    alpha: float
    """Seconds per byte offloaded (may be zero or negative)."""
    free: bool
    """Offloading every block was not shown slower than the plan by more than ``NOISE``."""
    interval: tuple[float, float] = (math.nan, math.nan)
    """The 95 % interval of offloading every block's step time over the plan's."""
    blocks: int = 0
    """Counted blocks the race ran."""

    def __str__(self) -> str:
        ratio = self.all_s / self.plan_s if self.plan_s > 0 else float("nan")
        lo, hi = self.interval
        how = (
            "offloading is free here: offloading every block, the least memory"
            if self.free
            else f"offloading costs {self.alpha * 2**30 * 1e3:.1f} ms per GiB here: planning "
            "with that"
        )
        return (
            f"{self.plan_s:.3f} s a step for the plan, {self.all_s:.3f} s offloading every block "
            f"({ratio:.3f}x, 95 % {lo:.3f}-{hi:.3f}, {self.blocks} blocks of A B B A): {how}"
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
    lo, hi = verdict.interval
    times = RaceTimes(verdict.plan_s, verdict.all_s, lo, hi, verdict.blocks)
    return dataclasses.replace(chosen, race=times)


@dataclass(slots=True)
class Race:
    """The race for one input shape (``signature``): the planner's plan against offloading every
    block (see [race])."""

    signature: tuple[Any, ...]
    plans: tuple[Plan, Plan]
    steps: list[float] = field(default_factory=list)
    """The raced steps' times, in the order run (``BLOCK`` over and over)."""
    running: int | None = None
    """The plan the step now running was given (None: not a raced step)."""
    started: float = 0.0
    ended: float | None = None  # the running step's backward reached the first block's input
    others: int = 0  # forwards of other shapes since its own last ran

    @property
    def turn(self) -> int:
        """Raced steps begun."""
        return len(self.steps) + (self.running is not None)

    def begin(self, t0: float) -> Plan:
        """A step of this shape, begun at ``t0``, runs the plan whose turn it is."""
        self.running = BLOCK[len(self.steps) % len(BLOCK)]
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
            self.steps.append(stop - self.started)
            self.running = None

    def paired(self) -> list[float]:
        """Per counted block, log(offloading every block's two steps / the plan's two); a block
        whose steps took no time (a clock that did not move) tells nothing and is left out."""
        n = len(BLOCK)
        out = []
        for k in range(WARM_BLOCKS, len(self.steps) // n):
            block = self.steps[k * n : (k + 1) * n]
            a = sum(t for t, p in zip(block, BLOCK, strict=True) if p == 0)
            b = sum(t for t, p in zip(block, BLOCK, strict=True) if p == 1)
            if a > 0 and b > 0:
                out.append(math.log(b / a))
        return out

    def interval(self) -> tuple[float, float, float]:
        """The paired ratio's estimate and its 95 % interval (of the mean log ratio)."""
        d = self.paired()
        if not d:
            return 1.0, 0.0, math.inf  # nothing measured: not shown apart
        m = statistics.fmean(d)
        half = _T95[len(d) - 2] * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
        return math.exp(m), math.exp(m - half), math.exp(m + half)

    @property
    def done(self) -> bool:
        """Told apart (the interval on one side of ``NOISE``), or ``MAX_BLOCKS`` counted."""
        if self.running is not None or len(self.steps) % len(BLOCK):
            return False
        if len(self.steps) // len(BLOCK) - WARM_BLOCKS >= MAX_BLOCKS:
            return True
        if len(self.paired()) < MIN_BLOCKS:
            return False
        _, lo, hi = self.interval()
        return lo > 1 + NOISE or hi <= 1 + NOISE

    def verdict(self) -> Verdict:
        plan, every = self.plans
        ratio, lo, hi = self.interval()
        counted = [t for k, t in enumerate(self.steps) if k >= WARM_BLOCKS * len(BLOCK)]
        t_plan = statistics.median(t for k, t in enumerate(counted) if BLOCK[k % len(BLOCK)] == 0)
        t_all = t_plan * ratio
        moved = offloaded_bytes(every) - offloaded_bytes(plan)
        recomputed = sum(
            b.forward_s for b, d in zip(plan.blocks, plan.decisions, strict=True) if d == RECOMPUTE
        )
        alpha = (t_all - t_plan + recomputed) / moved if moved > 0 else 0.0
        return Verdict(
            t_plan,
            t_all,
            alpha,
            free=lo <= 1 + NOISE,
            interval=(lo, hi),
            blocks=len(self.paired()),
        )


def offloaded_bytes(plan: Plan) -> int:
    """What ``plan`` offloads a step: the saved bytes of its offloaded units."""
    return sum(b.saved for b, d in zip(plan.blocks, plan.decisions, strict=True) if d == OFFLOAD)
