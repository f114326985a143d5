"""Under a memory budget, offloadd picks keep, offload or recompute per block (see [auto])."""

from offloadd.auto.discover import find_blocks
from offloadd.auto.plan_report import plan_dict, plan_table
from offloadd.auto.planner import AutoPlanner
from offloadd.auto.recompute import RecomputeMismatch
from offloadd.auto.solver import BlockCost, InfeasibleBudget, Plan, smallest_budget, solve

__all__ = [
    "AutoPlanner",
    "BlockCost",
    "InfeasibleBudget",
    "Plan",
    "RecomputeMismatch",
    "find_blocks",
    "plan_dict",
    "plan_table",
    "smallest_budget",
    "solve",
]
