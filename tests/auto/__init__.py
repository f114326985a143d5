"""Tests of offloadd/auto/: the budget planner."""
