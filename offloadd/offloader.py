"""``offloadd.Offloader``: the runtime's saved-tensor hooks with the optional stages wired in.

The runtime (:mod:`offloadd.runtime`) owns the pack path and the interfaces of its two optional
stages (runtime/stages.py); the budget planner (:mod:`offloadd.auto`) and the codec
(:mod:`offloadd.codec`) implement them and import the runtime. This module is the edge that
joins them: the one place that imports all three.
"""

from __future__ import annotations

from typing import Any

from offloadd.auto.planner import AutoPlanner
from offloadd.auto.solver import Plan
from offloadd.codec.coder import Codec
from offloadd.config import Config
from offloadd.io.request import Engine
from offloadd.runtime import offloader
from offloadd.runtime.accounting import Ledger
from offloadd.runtime.ordering import Ordering
from offloadd.runtime.stages import Stages

__all__ = ["STAGES", "Offloader"]


def _planner(cfg: Config, ledger: Ledger, tls: Any) -> AutoPlanner:
    assert cfg.budget is not None
    return AutoPlanner(cfg.budget, offload=cfg.tier != "keep", ledger=ledger, tls=tls)


STAGES = Stages(planner=_planner, coder=Codec)
"""The budget planner (``Config.budget``) and the codec (``Config.codec``)."""


class Offloader(offloader.Offloader):
    """Saved-tensor hooks that offload activations; use as a context manager around forward.

    ``Offloader(tier="ssd", ssd_dirs=[...])``, ``Offloader(Config(...))``, or both (keyword
    arguments override the config's fields). ``io_engine`` plugs in another engine (embedded
    backend); ``ordering`` another device ordering (tests: ``SimulatedOrdering``). With
    ``budget`` set it plans keep, offload or recompute per block (see [auto] in
    auto/planner.py); with ``codec`` set it stores lossy codes of the activations the codec
    allows (see [codes through the tiers] in codec/coder.py). The rest is
    :class:`offloadd.runtime.offloader.Offloader`'s.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        io_engine: Engine | None = None,
        ordering: Ordering | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__(config, io_engine=io_engine, ordering=ordering, stages=STAGES, **overrides)

    def plan(self) -> Plan | None:
        """With a budget: the plan of the last step planned (see [auto] in auto/planner.py),
        made now if a profile step's backward has run; None before that, or without a budget."""
        plan: Plan | None = super().plan()
        return plan

    @property
    def planner(self) -> AutoPlanner | None:
        """The budget planner (None without a budget)."""
        planner = self._auto
        assert planner is None or isinstance(planner, AutoPlanner)
        return planner
