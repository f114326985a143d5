"""The plans of one planner, per input shape: made from the profile's costs, priced by the race's
verdict, made again when a step used more than its budget (see [auto] in planner.py, [the plan]
in solver.py, [race] in race.py)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from offloadd.auto.plan_report import plan_table
from offloadd.auto.race import RACE_STEPS_MAX, RACE_STEPS_MIN, Race, Verdict, decide, priced
from offloadd.auto.solver import (
    KEEP,
    BlockCost,
    InfeasibleBudget,
    Plan,
    offload_all,
    plan_peak,
    solve,
)
from offloadd.units import format_bytes

__all__ = ["ShapePlans"]

log = logging.getLogger("offloadd")

Sig = tuple[Any, ...]


class ShapePlans:
    """Plans per input shape under ``budget`` (bytes, or a float: a fraction of keep's
    footprint); ``offload``: whether the tier can offload (False for tier keep)."""

    def __init__(self, budget: int | float, offload: bool) -> None:
        self.budget = budget
        self.offload = offload
        # per shape: the profile's costs, its peak held (base) and its peak kept (kept base)
        self.costs: dict[Sig, tuple[list[BlockCost], int, int]] = {}
        self.footprint: dict[Sig, int] = {}  # keep's, from the profile
        self.plans: dict[Sig, Plan] = {}
        self.planned: set[Sig] = set()  # shapes that ever had a plan
        self.verdicts: dict[Sig, Verdict | None] = {}  # the races' (None: racing)
        self.race: Race | None = None
        self.waiting: dict[Sig, tuple[Plan, Plan]] = {}  # races to run when this one is done
        self.measure: str | None = None  # the probe measuring peaks (None: offloadd's accounting)
        self.held: Callable[[], int] = lambda: 0  # what the model holds elsewhere (relay)
        self.refused: set[Sig] = set()  # shapes whose first profile no plan fitted
        self.never: set[int] = set()  # blocks never to recompute (Note [recomputed state])

    # Note [refused once]
    # ~~~~~~~~~~~~~~~~~~~
    # A profile measures one step, and one step can hold more than the model needs: writes
    # behind a disk that stalled then (the profile's room is one chunk, Note [room for writes]),
    # a burst of the allocator. On a small model that can put the smallest feasible budget
    # above a budget that fits every other step, and a run that trains in most tries would stop
    # in a few. So a first profile that no plan fits is warned about and dropped, and the shape
    # is profiled again at its next forward; only a second refusal raises.
    def learn(self, sig: Sig, costs: list[BlockCost], base: int, kept: int) -> Plan | None:
        """A profile's costs, ``base`` and ``kept`` its peaks held and kept: the first plan, or
        None where no plan fits and the shape is to be profiled again (Note [refused once])."""
        if not self.offload:  # tier keep: the blocks' saved bytes were kept in the profile too
            kept = max(0, kept - sum(b.saved for b in costs))
            base = kept
        self.costs[sig] = (costs, base, kept)
        # a fraction's bytes are fixed by the profile: replans that grow the base do not grow it
        floor = 0 if costs[0].measured else kept
        self.footprint[sig] = plan_peak(costs, (KEEP,) * len(costs), floor)
        try:
            return self.plan_for(sig)
        except InfeasibleBudget as e:
            if sig in self.refused:
                raise
            self.refused.add(sig)
            del self.costs[sig]
            log.warning("offloadd: %s; profiling that step once more before refusing it", e)
            return None

    def plan_for(self, sig: Sig) -> Plan:
        """Plan shape ``sig`` from its costs (priced by its race's verdict); the first plan of a
        shape starts its race where offloading every block fits and is another plan."""
        costs, base, kept = self.costs[sig]
        budget = self.budget
        # Relayed weights count in the budget, and in keep's peak that a fraction is of.
        held = self.held()
        keep = self.keep_footprint(sig) + held
        total = int(budget * keep) if isinstance(budget, float) else budget
        nbytes = max(0, total - held)
        if self.race is not None and self.race.signature == sig:
            self.race = None  # a replan: the race's plans are stale; it races again below
            self.verdicts.pop(sig, None)
        verdict = self.verdicts.get(sig)
        costs = [
            dataclasses.replace(b, recomputable=False) if k in self.never else b
            for k, b in enumerate(priced(costs, verdict))
        ]
        try:
            plan = solve(costs, base, nbytes, kept_base=kept, offload=self.offload)
        except InfeasibleBudget as e:
            if sig not in self.planned:  # the first plan for this shape: say so at once
                never = [b.name for b in costs[:-1] if not b.recomputable]  # not the head
                raise InfeasibleBudget(
                    total,
                    e.smallest + held,
                    keep if isinstance(budget, float) else None,
                    never,
                    held,
                ) from None
            # Planning again after a step held more than predicted: never stop a training run.
            log.warning("offloadd: %s; using the leanest plan", e)
            plan = solve(costs, base, e.smallest, kept_base=kept, offload=self.offload)
        every = offload_all(costs, base, nbytes) if self.offload else None
        if every is not None and (every.peak > nbytes or every.decisions == plan.decisions):
            every = None  # nothing to race: offloading every block does not fit, or is the plan
        if costs[0].measured and self.measure is not None:
            plan = dataclasses.replace(plan, measure=self.measure)
            if every is not None:
                every = dataclasses.replace(every, measure=self.measure)
        plan = decide(plan, every, verdict)
        self.plans[sig] = plan
        self.planned.add(sig)
        log.info("offloadd: %s", plan_table(plan))
        if every is not None and sig not in self.verdicts:
            self.waiting[sig] = (plan, every)
            self.start_race(sig)
        return plan

    def start_race(self, sig: Sig) -> Race | None:
        """Start shape ``sig``'s race if it waits for one and none runs (see [race])."""
        if self.race is not None or sig not in self.waiting:
            return self.race
        self.verdicts[sig] = None
        self.race = Race(sig, self.waiting.pop(sig))
        log.info(
            "offloadd: budget: racing this plan against offloading every block, %d to %d steps "
            "in all, to learn what offloading costs here",
            RACE_STEPS_MIN,
            RACE_STEPS_MAX,
        )
        return self.race

    def give_way(self) -> None:
        """The race's shape has not come back for a while: it waits again (see [race])."""
        race, self.race = self.race, None
        assert race is not None
        self.verdicts.pop(race.signature, None)
        self.waiting[race.signature] = race.plans

    @property
    def racing(self) -> bool:
        """A race runs or waits."""
        return self.race is not None or bool(self.waiting)

    def finish_race(self) -> tuple[Sig, Plan] | None:
        """The race has run: take its verdict and plan its shape again with it."""
        race, self.race = self.race, None
        assert race is not None
        self.verdicts[race.signature] = verdict = race.verdict()
        log.info("offloadd: budget: race: %s", verdict)
        if race.signature not in self.costs:
            return None
        return race.signature, self.plan_for(race.signature)

    def over_budget(self, sig: Sig, held: int, plan: Plan) -> Plan:
        """A step of ``plan`` used ``held`` bytes, over its budget: every unit needs the excess
        more from now on; plan again."""
        costs, base, kept = self.costs[sig]
        over = held - plan.peak
        self.costs[sig] = (_shifted(costs, over), base + over, kept + over)
        log.warning(
            "offloadd: budget: the step used %s, over the budget of %s (predicted %s); "
            "planning again with every unit needing %s more",
            format_bytes(held),
            format_bytes(plan.budget),
            format_bytes(plan.peak),
            format_bytes(over),
        )
        return self.plan_for(sig)

    def forget(self, sig: Sig) -> None:
        """Shape ``sig`` is profiled again: its plan, costs and race go."""
        del self.plans[sig], self.costs[sig]
        self.verdicts.pop(sig, None)  # races again after the profile
        self.waiting.pop(sig, None)
        if self.race is not None and self.race.signature == sig:
            self.race = None

    def keep_footprint(self, sig: Sig | None = None) -> int:
        """Keep's predicted footprint for shape ``sig`` (default: the last profiled): the peak
        kept in the profile step plus every block's saved bytes."""
        if sig is None:
            sig = next(reversed(self.footprint))
        return self.footprint[sig]


def _shifted(costs: list[BlockCost], over: int) -> list[BlockCost]:
    """``costs`` with every measured peak and level ``over`` bytes higher."""
    return [
        dataclasses.replace(
            b,
            peak_fwd=(b.peak_fwd or 0) + over,
            peak_bwd=(b.peak_bwd or 0) + over,
            level_bwd=(b.level_bwd or 0) + over,
        )
        if b.measured
        else b
        for b in costs
    ]
