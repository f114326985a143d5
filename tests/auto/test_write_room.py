"""The room a plan leaves for writes: with a budget, the CPU tensors the ssd tier holds while they
are written in place stay within what the plan leaves of its budget, also on a slow disk;
without one, within ``staging_bytes`` (see [room for writes] in runtime/writer_in_place.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from offloadd import Offloader
from offloadd.auto import plan_dict
from offloadd.auto.planner import AutoPlanner
from offloadd.auto.probe import CudaProbe
from offloadd.auto.solver import OFFLOAD, BlockCost, Plan
from offloadd.runtime.accounting import Ledger
from offloadd.runtime.stages import PlannerView
from offloadd.runtime.thread_state import ThreadState
from offloadd.tools.models.gpt import GPT, GPTConfig
from tests._support.auto_train import train
from tests._support.helpers import SlowEngine

MiB = 1 << 20
CHUNK = 256 << 10
STAGING = 16 * MiB
DELAY_S = 0.01  # per chunk written: a disk far slower than this model's forward


def _model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(num_layers=4, d_model=128, num_heads=4, seq_len=64, vocab_size=256))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (4, 65), generator=g) for _ in range(n)]


def _offloader(disk_dir: Path, delay_s: float = DELAY_S, **kw: Any) -> Offloader:
    return Offloader(
        tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=64 << 10, chunk_bytes=CHUNK,
        staging_bytes=STAGING, host_allocator="system", io_engine=SlowEngine(delay_s), **kw,
    )  # fmt: skip


Write = tuple[int, int, int, Plan | None, bool]
"""One in-place write's start: bytes held with it, its block's bytes, the limit, the plan
running (None: none), whether a profile step runs."""


def _record_writes(off: Offloader) -> list[Write]:
    """Each in-place write as it starts, read under the lock right after its wait for room."""
    in_place = off.runtime.writer.in_place
    assert in_place is not None
    seen: list[Write] = []
    wait_room = in_place._wait_room

    def record(nbytes: int) -> None:
        wait_room(nbytes)  # the block's bytes are added to held_bytes next, under this lock
        planner = off.planner
        plan = planner.plan if planner is not None else None
        profiling = planner is not None and planner._profile is not None and plan is None
        seen.append((in_place.held_bytes + nbytes, nbytes, in_place.limit(), plan, profiling))

    in_place._wait_room = record  # type: ignore[method-assign]
    return seen


def _train(
    off: Offloader | None, batches: list[torch.Tensor], room: int | None = None
) -> tuple[list[float], list[torch.Tensor]]:
    """SGD steps; with ``room``, once a plan exists it offloads every block and leaves ``room``
    of its budget (no race: the plan as set here, every step)."""

    def offload_all(plan: Plan) -> Plan:
        assert room is not None
        return dataclasses.replace(
            plan, decisions=(OFFLOAD,) * len(plan.decisions), peak=plan.budget - room
        )

    weights, losses = train(_model(), off, batches, None if room is None else offload_all)
    return losses, weights


@pytest.mark.parametrize("room", [2 * MiB, 0], ids=["2MiB", "none-left"])
def test_a_plan_bounds_what_writes_hold(disk_dir: Path, room: int) -> None:
    """On a slow disk, a step under a plan holds sources being written only up to what the plan
    leaves of its budget (at least one chunk, and one block alone), and a profile step only one
    chunk (its peaks are the plan's own); the warm-up step is bounded by ``staging_bytes``;
    gradients stay bit-identical."""
    batches = _batches(5)
    ref = _train(None, batches)
    off = _offloader(disk_dir, budget="100x")
    writes = _record_writes(off)
    got = _train(off, batches, room)
    off.close()
    assert got[0] == ref[0] and all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))
    for held, nbytes, lim, plan, _ in writes:  # one block may always be held alone
        assert held <= lim or held == nbytes
        if plan is not None:  # the first planned step's too (a race's contender)
            assert lim == min(STAGING, max(CHUNK, plan.room))
    forced = [w for w in writes if w[3] is not None and w[3].peak == w[3].budget - room]
    profiled = [w for w in writes if w[4]]
    warm_up = [w for w in writes if w[3] is None and not w[4]]
    assert forced and profiled and warm_up
    limit = max(CHUNK, room)
    for held, _, lim, plan, _ in forced:
        assert plan is not None and plan.room == room and lim == limit
        if room:
            assert plan.peak + held <= plan.budget
    assert all(lim == CHUNK for _, _, lim, _, _ in profiled)
    assert all(lim == STAGING for _, _, lim, _, _ in warm_up)


def test_without_a_budget_writes_hold_up_to_staging_bytes(disk_dir: Path) -> None:
    """No budget: the bound is ``staging_bytes``, and a slow disk falls behind by more than the
    rooms above (a disk 5x slower still: a forward on a loaded machine must not keep up)."""
    off = _offloader(disk_dir, 5 * DELAY_S)
    writes = _record_writes(off)
    assert (
        off.runtime.writer.in_place is not None and off.runtime.writer.in_place.limit() == STAGING
    )
    _train(off, _batches(1))
    off.close()
    assert writes and all(lim == STAGING for _, _, lim, _, _ in writes)
    assert all(held <= STAGING or held == nbytes for held, nbytes, *_ in writes)
    assert max(held for held, *_ in writes) > 2 * MiB  # the slow disk fell behind


def test_write_room_is_the_running_plans() -> None:
    """The room is the plan's budget less its predicted peak; none in a profile step; no bound
    in the warm-up step, nor where the budget is CUDA's memory, which the held CPU tensors are
    not."""
    planner = AutoPlanner(64 * MiB, offload=True, view=PlannerView(Ledger(0), ThreadState()))
    assert planner.write_room() is None  # warm-up
    planner._profile = object()  # type: ignore[assignment]
    assert planner.write_room() == 0  # a profile step: one chunk (see [room for writes])
    planner._profile = None
    block = BlockCost(
        name="b0", saved=8 * MiB, inputs=MiB, forward_s=0.01, backward_s=0.02, offload_s=0.0
    )
    plan = Plan(
        decisions=(OFFLOAD,), budget=64 * MiB, base=0, peak=60 * MiB, extra_s=0.0, blocks=(block,)
    )
    planner.plan = plan
    assert planner.write_room() == plan.room == plan_dict(plan)["write_room_bytes"] == 4 * MiB
    planner.plan = dataclasses.replace(plan, peak=65 * MiB)  # a step over budget: no room
    assert planner.write_room() == 0
    planner.probe = CudaProbe(torch.device("cuda"))  # measures device memory only
    assert planner.write_room() is None
