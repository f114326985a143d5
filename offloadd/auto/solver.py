"""The plan: keep, offload or recompute for each block, fastest first, within a memory budget.

Note: [the plan] The blocks run in order, then the head (what runs after the blocks: the head and
the loss); backward runs them in reverse. While unit ``k`` runs, forward or backward, what the
units before it hold is held too; the units after it hold nothing in forward (not run yet) and
nothing in backward (their backward is done, their saved tensors freed). So a plan's peak is

    max over units k of  prefix(k) + need(k)

where ``prefix(k)`` sums what each earlier unit holds under its decision (kept: its saved bytes;
recomputed: its inputs, non-reentrant checkpointing keeps only those; offloaded: nothing) and
``need(k)`` is the memory unit ``k`` itself needs while it runs, forward or backward. With
measured peaks (see [measured peaks] in probe.py), the profile step gives, per unit, the most
memory in use during its forward (``peak_fwd``) and its backward (``peak_bwd``) above the step's
start, with every earlier unit holding nothing, as in the profile, where every unit was offloaded;
then a kept unit needs ``max(peak_fwd + saved, peak_bwd)`` (its saved tensors stay on top of its
forward; in backward the profile read them back, so they are counted already), an offloaded one
``max(peak_fwd, peak_bwd)``, and a recomputed one its inputs plus ``max(peak_fwd, peak_bwd,
level_bwd + rise_fwd)``: its forward runs again when its backward begins, raising memory by
``rise_fwd`` from the level then. Without measured peaks (torch's own CPU allocator), the peaks
are offloadd's own accounting: every peak and level is ``base``, what offloadd held in the profile
step (what is saved before the blocks, small tensors, the windows of writes in flight and
read-backs), and a recomputed block's rise is its saved bytes; a plan that offloads nothing has no
windows and uses ``kept_base``, the peak of what was kept in that step.

The extra time over keeping everything is ``forward_s[k]`` for a recomputed block (its forward
runs again) and ``offload_s[k]`` for an offloaded one: the I/O wait measured while that block was
offloaded in the profile (none where it is too small to tell from noise, see ``HIDDEN`` in
profile.py), plus a tie-break that grows with its bytes and towards the last block, so that when
the I/O hides everywhere the tail is kept first (TBA's adaptive keep: backward needs
it first). The head may be kept or offloaded but not recomputed: backward needs it first, so it
is kept whenever it fits (anchors' trap: offloading it costs bandwidth), but a head over a large
vocabulary (GPT-2's logits) can be most of the memory, and offloading it is then what makes a
budget fit.

Minimising the summed extra time under that peak is a dynamic programme over the units in order
whose state is the prefix, in ``units`` steps of ``budget / units`` bytes, each unit's memory
rounded *up* to whole steps (``(budget - floor) / units``): a decision is allowed where the rounded prefix plus its need fits the
budget. So a plan :func:`solve` returns always fits, and it is at least as fast as the best plan
for a budget smaller by ``n`` steps (the rounding). With n units and 3 choices that is O(n *
units), a few milliseconds for 48 blocks. The smallest feasible budget comes from the same
programme minimising the peak instead of the time; a budget below it raises
:class:`InfeasibleBudget` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "KEEP",
    "OFFLOAD",
    "RECOMPUTE",
    "BlockCost",
    "InfeasibleBudget",
    "Plan",
    "RaceTimes",
    "offload_all",
    "plan_peak",
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
    peak_fwd: int | None = None
    """Measured: most bytes in use during its forward above the step's start, earlier units
    holding nothing (see [the plan]); None: not measured (offloadd's own accounting is used)."""
    peak_bwd: int | None = None
    """Measured: the same during its backward."""
    level_bwd: int | None = None
    """Measured: bytes in use when its backward began, on the same footing."""
    rise_fwd: int | None = None
    """Measured: how far its forward raised memory above the level it began at."""

    @property
    def measured(self) -> bool:
        return self.peak_fwd is not None


class RaceTimes(NamedTuple):
    """What the race that chose a plan measured (see [race] in race.py)."""

    plan_s: float
    """The median step time of the profile's plan."""
    all_s: float
    """``plan_s`` times the paired ratio: offloading every block's."""
    low: float = math.nan
    """The paired ratio's 95 % interval, low end ..."""
    high: float = math.nan
    """... and high end."""
    blocks: int = 0
    """Counted blocks of A B B A."""

    def __str__(self) -> str:
        ratio = self.all_s / self.plan_s if self.plan_s > 0 else math.nan
        return f"{ratio:.3f}x (95 % {self.low:.3f}-{self.high:.3f}, {self.blocks} blocks)"


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
    measure: str = "held"
    """What the peak counts: ``"held"`` (offloadd's own accounting) or the probe that measured
    the blocks' peaks (``"host cache"``, ``"cuda"``; see [measured peaks] in probe.py)."""
    race: RaceTimes | None = None
    """The race that chose this plan (see [race] in race.py); None: no race (yet)."""

    @property
    def room(self) -> int:
        """What the budget leaves over the predicted peak: the most bytes a step may hold in
        sources being written (see [room for writes] in runtime/writer_in_place.py)."""
        return max(0, self.budget - self.peak)

    def count(self, decision: str) -> int:
        return sum(d == decision for d in self.decisions)

    def extra_of(self, k: int) -> float:
        """The predicted extra seconds of block ``k`` under its decision."""
        b, d = self.blocks[k], self.decisions[k]
        return b.forward_s if d == RECOMPUTE else b.offload_s if d == OFFLOAD else 0.0


class InfeasibleBudget(ValueError):
    """The budget is below what the leanest plan needs."""

    def __init__(
        self,
        budget: int,
        smallest: int,
        keep: int | None = None,
        never: list[str] | None = None,
        relayed: int = 0,
    ) -> None:
        self.budget, self.smallest, self.keep = budget, smallest, keep
        of = (lambda n: f", {n / keep:.2f}x keep's peak") if keep else (lambda n: "")
        why = (
            f"; never recomputed (their forward changes their inputs, buffers or attributes, or a "
            f"recomputation differed: Note [recomputed state]): {', '.join(never)}"
            if never
            else ""
        )
        if relayed:
            why += (
                f"; both count the {relayed} bytes ({relayed / 2**20:.1f} MiB) relay holds for "
                "frozen weights (its slabs' peak)"
            )
        super().__init__(
            f"budget: {budget} bytes ({budget / 2**20:.1f} MiB{of(budget)}) is below the smallest "
            f"feasible budget for this model and step, {smallest} bytes "
            f"({smallest / 2**20:.1f} MiB{of(smallest)}){why}"
        )


def _extra(b: BlockCost, k: int, decision: str) -> float:
    if decision == KEEP:
        return 0.0
    if decision == RECOMPUTE:
        return b.forward_s
    return max(0.0, b.offload_s) + _TAIL_TIE_S * b.saved * (k + 1)


def _memory(b: BlockCost, decision: str) -> int:
    """What the unit holds while later units run."""
    return b.saved if decision == KEEP else b.inputs if decision == RECOMPUTE else 0


def _need(b: BlockCost, decision: str, floor: int) -> int:
    """What the unit needs while it runs, over the prefix (see [the plan])."""
    if b.measured:
        pf, pb = floor + (b.peak_fwd or 0), floor + (b.peak_bwd or 0)
        lb, rise = floor + (b.level_bwd or 0), b.rise_fwd or 0
    else:
        pf = pb = lb = floor
        rise = b.saved
    if decision == KEEP:
        return max(pf + b.saved, pb)
    if decision == OFFLOAD:
        return max(pf, pb)
    return b.inputs + max(pf, pb, lb + rise)


def plan_peak(blocks: list[BlockCost], decisions: tuple[str, ...], floor: int) -> int:
    """The predicted peak of ``decisions`` (see [the plan])."""
    peak = prefix = 0
    for b, d in zip(blocks, decisions, strict=True):
        peak = max(peak, prefix + _need(b, d, floor))
        prefix += _memory(b, d)
    return peak


def _variants(
    blocks: list[BlockCost], base: int, kept_base: int, offload: bool
) -> list[tuple[tuple[str, ...], int]]:
    """(choices, floor) to plan over: measured peaks already hold offloadd's windows."""
    if blocks and all(b.measured for b in blocks):
        return [((KEEP, OFFLOAD, RECOMPUTE) if offload else (KEEP, RECOMPUTE), 0)]
    out: list[tuple[tuple[str, ...], int]] = [((KEEP, RECOMPUTE), kept_base)]
    if offload:
        out.append(((KEEP, OFFLOAD, RECOMPUTE), base))
    return out


def _allowed(b: BlockCost, choices: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(c for c in choices if c != RECOMPUTE or (b.recomputable and b.inputs < b.saved))


def smallest_budget(
    blocks: list[BlockCost], base: int, *, kept_base: int | None = None, offload: bool = True
) -> int:
    """The least budget any plan fits in."""
    kept_base = base if kept_base is None else min(base, kept_base)
    return _leanest(blocks, base, kept_base, offload, 2048)[0]


def _leanest(
    blocks: list[BlockCost], base: int, kept_base: int, offload: bool, units: int
) -> tuple[int, tuple[str, ...], int]:
    """The plan that needs the least memory: (its peak, its decisions, its floor)."""
    best: tuple[int, tuple[str, ...], int] | None = None
    for choices, floor in _variants(blocks, base, kept_base, offload):
        ref = plan_peak(blocks, (KEEP,) * len(blocks), floor)
        step = max(1, math.ceil(ref / units))
        got = _programme(blocks, choices, floor, step, lambda _b, _k, _c: 0.0, None)
        if got is None:
            continue
        ds = got[1]
        peak = plan_peak(blocks, ds, floor)
        if best is None or peak < best[0]:
            best = (peak, ds, floor)
    assert best is not None  # keeping every unit is always a plan
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
    smallest, lean, lean_floor = _leanest(blocks, base, kept_base, offload, units)
    if budget < smallest:
        raise InfeasibleBudget(budget, smallest)
    variants = _variants(blocks, base, kept_base, offload)
    keep_floor = variants[0][1]
    keep_all = (KEEP,) * len(blocks)
    if plan_peak(blocks, keep_all, keep_floor) <= budget:  # everything kept fits: fastest
        return _plan(blocks, keep_all, budget, keep_floor)
    best: tuple[float, tuple[str, ...], int] | None = None
    for choices, floor in variants:
        step = max(1, math.ceil((budget - floor) / units))
        got = _programme(blocks, choices, floor, step, _extra, budget)
        if got is not None and (best is None or got[0] < best[0] - 1e-12):
            best = (got[0], got[1], floor)
    if best is None:  # a budget so tight that rounding lost every plan but the leanest
        return _plan(blocks, lean, budget, lean_floor)
    return _plan(blocks, best[1], budget, best[2])


def offload_all(blocks: list[BlockCost], base: int, budget: int) -> Plan:
    """Every unit offloaded: the leanest plan (an offloaded unit holds nothing and needs the
    least while it runs), so it fits wherever any plan does."""
    floor = 0 if blocks and all(b.measured for b in blocks) else base
    return _plan(blocks, (OFFLOAD,) * len(blocks), budget, floor)


def _plan(blocks: list[BlockCost], decisions: tuple[str, ...], budget: int, floor: int) -> Plan:
    extra = sum(
        b.forward_s if d == RECOMPUTE else b.offload_s if d == OFFLOAD else 0.0
        for b, d in zip(blocks, decisions, strict=True)
    )
    return Plan(
        decisions=decisions,
        budget=budget,
        base=floor,
        peak=plan_peak(blocks, decisions, floor),
        extra_s=extra,
        blocks=tuple(blocks),
    )


def _programme(
    blocks: list[BlockCost],
    choices: tuple[str, ...],
    floor: int,
    step: int,
    cost: Callable[[BlockCost, int, str], float],
    budget: int | None,
) -> tuple[float, tuple[str, ...]] | None:
    """The dynamic programme of [the plan] over the prefix in ``step`` bytes. With a ``budget``:
    the least summed ``cost`` among plans that fit it; without: the plan of least peak (its
    cost is then that peak). None if nothing fits."""
    # state: prefix in steps -> (value, back pointer); value: summed cost, or peak so far
    states: dict[int, float] = {0: 0.0}
    back: list[dict[int, tuple[int, str]]] = []
    for k, b in enumerate(blocks):
        new: dict[int, float] = {}
        picks: dict[int, tuple[int, str]] = {}
        for c in _allowed(b, choices):
            need, w = _need(b, c, floor), math.ceil(_memory(b, c) / step)
            for m, value in states.items():
                here = m * step + need
                if budget is not None:
                    if here > budget:
                        continue
                    v = value + cost(b, k, c)
                else:
                    v = max(value, float(here))
                m2 = m + w
                if v < new.get(m2, math.inf) - 1e-15:
                    new[m2], picks[m2] = v, (m, c)
        if not new:
            return None
        states = new
        back.append(picks)
    m = min(states, key=lambda s: states[s])
    value = states[m]
    decisions: list[str] = []
    for k in range(len(blocks) - 1, -1, -1):
        m, c = back[k][m]
        decisions.append(c)
    decisions.reverse()
    return value, tuple(decisions)
