"""The plan: keep, offload or recompute for each block, fastest first, within a memory budget.

Note: [the plan] A step's saved-activation memory under a plan is predicted as

    base + sum(saved[k] for kept k) + sum(inputs[k] for recomputed k) + transient

``base`` is what is held whatever the blocks do: what is saved before the blocks (embeddings),
small tensors, and offloadd's own windows (writes in flight, the prefetch window), measured in the
profile step, in which every block was offloaded; a plan that offloads no block has no windows and
uses ``kept_base``, the peak of what was kept in that step. A recomputed block keeps only its
inputs (non-reentrant checkpointing), but while backward recomputes it its saved tensors exist
again: ``transient`` is the largest ``saved[k]`` among recomputed blocks (0 if none). An offloaded
block costs no memory beyond ``base``. The extra time over keeping everything is ``forward_s[k]``
for a recomputed block (its forward runs again) and ``offload_s[k]`` for an offloaded one: the I/O
wait measured while that block was offloaded in the profile, plus a tie-break that grows with its
bytes and towards the last block, so that when the I/O hides everywhere the tail is kept first
(TBA's adaptive keep: backward needs it first). What runs after the blocks (the head and the loss)
is one more unit, last, that may be kept or offloaded but not recomputed: backward needs it first,
so it is kept whenever it fits (anchors' trap: offloading it costs bandwidth), but a head over a
large vocabulary (GPT-2's logits) can be most of the memory, and offloading it is then what makes a
budget fit.

Minimising the summed extra time subject to the memory sum is a multiple-choice knapsack. For each
candidate transient ``t`` (0, or the saved bytes of some block; only blocks at most that large may
be recomputed), :func:`solve` runs the textbook dynamic programme over memory in ``units`` steps of
``(budget - base - t) / units`` bytes, each block's memory rounded *up* to whole steps, so a plan
it returns always fits the budget, and is at least as fast as the best plan for a budget smaller by
``n`` steps (the rounding); it keeps the fastest plan over all ``t``. When keeping every block
fits, that plan is returned at once. With n blocks, c distinct transients and 3 choices that is O(c
* n * units), a few milliseconds for 48 blocks. A budget below what the leanest plan needs raises
:class:`InfeasibleBudget` naming that smallest budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "KEEP",
    "OFFLOAD",
    "RECOMPUTE",
    "BlockCost",
    "InfeasibleBudget",
    "Plan",
    "smallest_budget",
    "solve",
]

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"

# Seconds per byte offloaded and per unit of position: when offloading costs nothing measurable,
# keep the tail, the bytes backward needs first (1 GiB at the 10th unit: 0.1 ms).
_TAIL_TIE_S = 1e-14


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCost:
    """What one block saves and costs, from the profile."""

    name: str
    saved: int
    """Bytes its forward saves that keep holds and offload or recompute removes."""
    inputs: int
    """Bytes recompute keeps instead: the block's tensor inputs."""
    forward_s: float
    backward_s: float
    offload_s: float
    """Extra seconds when it is offloaded: the I/O wait measured for it (>= 0)."""
    recomputable: bool = True
    """False for what runs after the blocks (the head and the loss): keep or offload only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One decision per block, and what the plan predicts."""

    decisions: tuple[str, ...]
    budget: int
    base: int
    peak: int
    """Predicted peak saved-activation bytes (see [the plan])."""
    extra_s: float
    """Predicted seconds over keeping every block."""
    blocks: tuple[BlockCost, ...] = field(repr=False)

    def count(self, decision: str) -> int:
        return sum(d == decision for d in self.decisions)

    def extra_of(self, k: int) -> float:
        """The predicted extra seconds of block ``k`` under its decision."""
        b, d = self.blocks[k], self.decisions[k]
        return b.forward_s if d == RECOMPUTE else b.offload_s if d == OFFLOAD else 0.0


class InfeasibleBudget(ValueError):
    """The budget is below what the leanest plan needs."""

    def __init__(self, budget: int, smallest: int) -> None:
        self.budget, self.smallest = budget, smallest
        super().__init__(
            f"budget: {budget} bytes ({budget / 2**20:.1f} MiB) is below the smallest feasible "
            f"budget for this model and step, {smallest} bytes ({smallest / 2**20:.1f} MiB)"
        )


def _extra(b: BlockCost, k: int, decision: str) -> float:
    if decision == KEEP:
        return 0.0
    if decision == RECOMPUTE:
        return b.forward_s
    return max(0.0, b.offload_s) + _TAIL_TIE_S * b.saved * (k + 1)


def _memory(b: BlockCost, decision: str) -> int:
    return b.saved if decision == KEEP else b.inputs if decision == RECOMPUTE else 0


def smallest_budget(
    blocks: list[BlockCost], base: int, *, kept_base: int | None = None, offload: bool = True
) -> int:
    """The least budget any plan fits in."""
    return _leanest(blocks, base, base if kept_base is None else kept_base, offload)[0]


def _leanest(
    blocks: list[BlockCost], base: int, kept_base: int, offload: bool
) -> tuple[int, tuple[str, ...]]:
    """The plan that needs the least memory, and that memory."""
    best = (kept_base + sum(b.saved for b in blocks), (KEEP,) * len(blocks))
    for t in sorted({b.saved for b in blocks if b.recomputable}):  # recompute up to t
        ds = tuple(
            RECOMPUTE if b.recomputable and b.saved <= t and b.inputs < b.saved else KEEP
            for b in blocks
        )
        if RECOMPUTE not in ds:
            continue
        mem = kept_base + t + sum(_memory(b, d) for b, d in zip(blocks, ds, strict=True))
        if mem < best[0]:
            best = (mem, ds)
    if offload and base <= best[0]:
        best = (base, (OFFLOAD,) * len(blocks))
    return best


def solve(
    blocks: list[BlockCost],
    base: int,
    budget: int,
    *,
    kept_base: int | None = None,
    offload: bool = True,
    units: int = 2048,
) -> Plan:
    """The fastest plan whose predicted peak fits ``budget`` (see [the plan])."""
    kept_base = base if kept_base is None else min(base, kept_base)
    smallest, lean = _leanest(blocks, base, kept_base, offload)
    if budget < smallest:
        raise InfeasibleBudget(budget, smallest)
    if kept_base + sum(b.saved for b in blocks) <= budget:  # everything kept fits: fastest
        decisions = (KEEP,) * len(blocks)
        peak = kept_base + sum(b.saved for b in blocks)
        return Plan(
            decisions=decisions,
            budget=budget,
            base=kept_base,
            peak=peak,
            extra_s=0.0,
            blocks=tuple(blocks),
        )
    variants: list[tuple[tuple[str, ...], int]] = [((KEEP, RECOMPUTE), kept_base)]
    if offload:
        variants.append(((KEEP, OFFLOAD, RECOMPUTE), base))
    best: tuple[float, tuple[str, ...], int, int] | None = None
    for choices, floor in variants:
        got = _best_for(blocks, floor, budget, choices, units)
        if got is not None and (best is None or got[0] < best[0] - 1e-12):
            best = (*got, floor)
    if best is None:  # a budget so tight that rounding lost every plan but the leanest
        best = (0.0, lean, smallest, base if OFFLOAD in lean else kept_base)
    _extra_tied, decisions, peak, floor = best
    real_extra = sum(
        b.forward_s if d == RECOMPUTE else b.offload_s if d == OFFLOAD else 0.0
        for b, d in zip(blocks, decisions, strict=True)
    )
    return Plan(
        decisions=decisions,
        budget=budget,
        base=floor,
        peak=peak,
        extra_s=real_extra,
        blocks=tuple(blocks),
    )


def _best_for(
    blocks: list[BlockCost], base: int, budget: int, choices: tuple[str, ...], units: int
) -> tuple[float, tuple[str, ...], int] | None:
    """The fastest plan with these choices over ``base``: (extra, decisions, peak), or None."""
    best: tuple[float, tuple[str, ...], int] | None = None
    for t in [0, *sorted({b.saved for b in blocks if b.recomputable})]:
        room = budget - base - t
        if room < 0:
            continue
        allowed = [
            tuple(c for c in choices if c != RECOMPUTE or (t and b.recomputable and b.saved <= t))
            for b in blocks
        ]
        got = _knapsack(blocks, allowed, room, units)
        if got is None:
            continue
        extra, decisions = got
        if t and RECOMPUTE not in decisions:
            continue  # the same plan is found with t = 0, without the transient
        peak = base + sum(_memory(b, d) for b, d in zip(blocks, decisions, strict=True))
        peak += max(
            (b.saved for b, d in zip(blocks, decisions, strict=True) if d == RECOMPUTE), default=0
        )
        if best is None or extra < best[0] - 1e-12:
            best = (extra, decisions, peak)
    return best


def _knapsack(
    blocks: list[BlockCost], allowed: list[tuple[str, ...]], room: int, units: int
) -> tuple[float, tuple[str, ...]] | None:
    """Least summed extra time with summed memory <= room; None if nothing fits."""
    step = max(1, math.ceil(room / units)) if room > 0 else 1
    cap = room // step
    inf = math.inf
    dp = [0.0] * (cap + 1)  # dp[m]: least time with memory <= m steps (monotone in m)
    back: list[list[int]] = []
    for k, (b, opts) in enumerate(zip(blocks, allowed, strict=True)):
        costs = [(_extra(b, k, c), math.ceil(_memory(b, c) / step)) for c in opts]
        new = [inf] * (cap + 1)
        pick = [-1] * (cap + 1)
        for i, (time, w) in enumerate(costs):
            if w > cap:
                continue
            for m in range(w, cap + 1):
                v = dp[m - w] + time
                if v < new[m]:
                    new[m], pick[m] = v, i
        dp = new
        back.append(pick)
    if dp[cap] == inf:
        return None
    decisions: list[str] = []
    m = cap
    for k in range(len(blocks) - 1, -1, -1):
        i = back[k][m]
        c = allowed[k][i]
        decisions.append(c)
        m -= math.ceil(_memory(blocks[k], c) / step)
    decisions.reverse()
    return dp[cap], tuple(decisions)
