"""The solver on its own (offloadd/auto/solver.py): peaks by hand, the choices each block
allows, the budget's bounds, and the plan's own accounting (exactness against brute force is
tests/auto/test_auto.py)."""

from __future__ import annotations

import pytest

from offloadd.auto.solver import (
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    BlockCost,
    InfeasibleBudget,
    RaceTimes,
    offload_all,
    plan_peak,
    smallest_budget,
    solve,
)

pytestmark = pytest.mark.unit

MiB = 1 << 20


def _block(
    name: str, saved: int, *, inputs: int = 1, fwd: float = 0.01, io: float = 0.0, **kw: object
) -> BlockCost:
    return BlockCost(
        name=name,
        saved=saved * MiB,
        inputs=inputs * MiB,
        forward_s=fwd,
        backward_s=2 * fwd,
        offload_s=io,
        **kw,  # type: ignore[arg-type]
    )


def test_plan_peak_by_hand() -> None:
    a, b = _block("a", 10, inputs=2), _block("b", 6, inputs=1)
    floor = 3 * MiB
    # keep: a needs floor + 10 while it runs, then holds 10 while b needs floor + 6
    assert plan_peak([a, b], (KEEP, KEEP), floor) == 19 * MiB
    assert plan_peak([a, b], (OFFLOAD, OFFLOAD), floor) == floor
    # recompute a: it holds its inputs (2); its backward reruns its forward (+10 over floor)
    assert plan_peak([a, b], (RECOMPUTE, KEEP), floor) == 15 * MiB
    assert plan_peak([a, b], (RECOMPUTE, OFFLOAD), floor) == 15 * MiB


def test_everything_kept_when_it_fits() -> None:
    blocks = [_block(str(k), 4) for k in range(3)]
    plan = solve(blocks, 2 * MiB, 1 << 40)
    assert plan.decisions == (KEEP,) * 3 and plan.extra_s == 0.0
    assert plan.room == plan.budget - plan.peak and plan.count(KEEP) == 3


def test_a_budget_below_the_smallest_names_it() -> None:
    blocks = [_block(str(k), 8) for k in range(3)]
    least = smallest_budget(blocks, MiB)
    with pytest.raises(InfeasibleBudget) as e:
        solve(blocks, MiB, least - 1)
    assert e.value.smallest == least and e.value.budget == least - 1
    assert f"{least} bytes" in str(e.value)
    assert solve(blocks, MiB, least).peak <= least


def test_the_cheapest_plan_that_fits_is_taken_and_counted() -> None:
    x = _block("x", 32, inputs=1, fwd=0.001, io=0.5)  # recomputing it is cheap
    y = _block("y", 32, inputs=1, fwd=0.5, io=0.3)
    blocks = [x, y]
    # 34 MiB (and the DP's rounding): recompute x (34: it runs again over its inputs), keep y
    assert plan_peak(blocks, (RECOMPUTE, KEEP), MiB) == 34 * MiB
    plan = solve(blocks, MiB, 34 * MiB + 64 * 1024)
    assert plan.decisions == (RECOMPUTE, KEEP), plan
    assert plan.extra_s == pytest.approx(0.001) and plan.extra_of(0) == 0.001
    assert plan.count(RECOMPUTE) == plan.count(KEEP) == 1 and plan.extra_of(1) == 0.0
    # 33 MiB: recomputing x no longer fits; offloading y is cheaper than offloading x
    plan = solve(blocks, MiB, 33 * MiB)
    assert plan.decisions == (KEEP, OFFLOAD), plan
    assert plan.extra_s == pytest.approx(0.3) and plan.room == 0 and plan.peak == 33 * MiB


def test_the_head_and_blocks_whose_inputs_are_larger_are_never_recomputed() -> None:
    head = _block("head", 40, inputs=1, fwd=0.0001, io=1.0, recomputable=False)
    fat = _block("fat", 8, inputs=16, fwd=0.0001, io=1.0)
    plan = solve([fat, head], MiB, smallest_budget([fat, head], MiB))
    assert plan.decisions[1] != RECOMPUTE and plan.decisions[0] != RECOMPUTE


def test_without_offload_only_keep_and_recompute() -> None:
    blocks = [_block(str(k), 16, inputs=1) for k in range(4)]
    least = smallest_budget(blocks, MiB, offload=False)
    plan = solve(blocks, MiB, least, offload=False)
    assert OFFLOAD not in plan.decisions and RECOMPUTE in plan.decisions
    assert smallest_budget(blocks, MiB) <= least  # offloading can only make it smaller


def test_free_offloads_keep_the_tail_first() -> None:
    """No measurable I/O cost anywhere: the tie-break keeps the blocks backward needs first."""
    blocks = [_block(str(k), 8, inputs=8) for k in range(4)]  # recompute never allowed
    budget = plan_peak(blocks, (OFFLOAD, OFFLOAD, KEEP, KEEP), MiB)
    plan = solve(blocks, MiB, budget)
    assert plan.decisions == (OFFLOAD, OFFLOAD, KEEP, KEEP), plan


def test_offload_all_is_the_leanest_and_has_no_floor_when_measured() -> None:
    blocks = [_block(str(k), 8) for k in range(3)]
    plan = offload_all(blocks, 2 * MiB, 1 << 30)
    assert plan.decisions == (OFFLOAD,) * 3 and plan.base == 2 * MiB and plan.peak == 2 * MiB
    measured = [
        _block(str(k), 8, peak_fwd=MiB, peak_bwd=3 * MiB, level_bwd=0, rise_fwd=8 * MiB)
        for k in range(3)
    ]
    assert all(b.measured for b in measured) and not blocks[0].measured
    plan = offload_all(measured, 2 * MiB, 1 << 30)
    assert plan.base == 0 and plan.peak == 3 * MiB


def test_measured_peaks_by_hand() -> None:
    b = _block(
        "a", 10, inputs=2, peak_fwd=4 * MiB, peak_bwd=7 * MiB, level_bwd=MiB, rise_fwd=12 * MiB
    )
    assert plan_peak([b], (KEEP,), 0) == 14 * MiB  # its forward's peak with its saved bytes
    assert plan_peak([b], (OFFLOAD,), 0) == 7 * MiB  # its backward's
    assert plan_peak([b], (RECOMPUTE,), 0) == 2 * MiB + 13 * MiB  # inputs + level + rise


def test_no_blocks_is_an_empty_plan() -> None:
    plan = solve([], MiB, MiB)
    assert plan.decisions == () and plan.peak == 0 and plan.extra_s == 0.0


def test_race_times_read_as_a_ratio() -> None:
    assert str(RaceTimes(2.0, 3.0, 1.4, 1.6, 12)) == "1.500x (95 % 1.400-1.600, 12 blocks)"
    assert str(RaceTimes(0.0, 1.0)).startswith("nanx")
