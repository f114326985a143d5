"""The plan as people and programs read it: the table logged at INFO, the dict of JSON reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from offloadd.auto.solver import OFFLOAD, RECOMPUTE, Plan
from offloadd.units import format_bytes

__all__ = ["decision_counts", "plan_dict", "plan_summary", "plan_table"]


def decision_counts(decisions: Sequence[str]) -> str:
    """Blocks kept, offloaded, recomputed: ``"k2 o10 r0"``."""
    return " ".join(f"{d[0]}{list(decisions).count(d)}" for d in ("keep", OFFLOAD, RECOMPUTE))


def plan_summary(plan: Plan) -> str:
    """The budget and its plan in a few words, for the end-of-run line."""
    return (
        f"budget {format_bytes(plan.budget)}: plan {decision_counts(plan.decisions)} "
        f"(blocks kept, offloaded, recomputed), predicted peak {format_bytes(plan.peak)}"
        + (" (chosen by a race)" if plan.race is not None else "")
    )


def plan_table(plan: Plan) -> str:
    """The plan as the table logged at INFO: block, bytes, decision, predicted times."""
    how = "held by offloadd" if plan.measure == "held" else f"measured by {plan.measure}"
    head = (
        f"plan for a budget of {format_bytes(plan.budget)}: predicted peak "
        f"{format_bytes(plan.peak)} ({how}; base {format_bytes(plan.base)}; room for writes "
        f"{format_bytes(plan.room)}), "
        f"+{plan.extra_s * 1e3:.1f} ms per step over keeping every block; "
        f"{plan.count('keep')} keep, {plan.count(OFFLOAD)} offload, "
        f"{plan.count(RECOMPUTE)} recompute"
    )
    if plan.race is not None:
        head += (
            f"; chosen by a race ({plan.race.plan_s:.3f} s a step for the profile's plan, "
            f"{plan.race.all_s:.3f} s offloading every block: {plan.race})"
        )
    rows = [
        f"  {'block':<24} {'saved':>10} {'inputs':>10} {'fwd peak':>10} {'bwd peak':>10} "
        f"{'fwd ms':>8} {'bwd ms':>8} {'io ms':>7}  {'decision':<10} {'+ms':>6}"
    ]
    for k, (b, d) in enumerate(zip(plan.blocks, plan.decisions, strict=True)):
        pf = format_bytes(b.peak_fwd) if b.peak_fwd is not None else "-"
        pb = format_bytes(b.peak_bwd) if b.peak_bwd is not None else "-"
        rows.append(
            f"  {b.name:<24} {format_bytes(b.saved):>10} {format_bytes(b.inputs):>10} "
            f"{pf:>10} {pb:>10} "
            f"{b.forward_s * 1e3:>8.1f} {b.backward_s * 1e3:>8.1f} {b.offload_s * 1e3:>7.1f}  "
            f"{d:<10} {plan.extra_of(k) * 1e3:>6.1f}"
        )
    return "\n".join([head, *rows])


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan for the JSON report."""
    return {
        "budget_bytes": plan.budget,
        "base_bytes": plan.base,
        "predicted_peak_bytes": plan.peak,
        "write_room_bytes": plan.room,  # see [room for writes] in runtime/writer_in_place.py
        "predicted_extra_s": plan.extra_s,
        "measure": plan.measure,
        # the race that chose it: the profile's plan's median step, offloading all's (paired),
        # the paired ratio's 95 % interval and the blocks counted
        "race_s": list(plan.race[:2]) if plan.race is not None else None,
        "race_interval": list(plan.race[2:4]) if plan.race is not None else None,
        "race_blocks": plan.race.blocks if plan.race is not None else None,
        "race": str(plan.race) if plan.race is not None else None,
        "blocks": [
            {
                "name": b.name,
                "saved_bytes": b.saved,
                "input_bytes": b.inputs,
                "forward_s": b.forward_s,
                "backward_s": b.backward_s,
                "offload_s": b.offload_s,
                "peak_fwd_bytes": b.peak_fwd,
                "peak_bwd_bytes": b.peak_bwd,
                "decision": d,
                "predicted_extra_s": plan.extra_of(k),
            }
            for k, (b, d) in enumerate(zip(plan.blocks, plan.decisions, strict=True))
        ],
    }
