"""The model a budget plans: the first module called in the scope, its blocks found and hooked,
and let go with it (Note [auto] in planner.py)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

from torch import nn

from offloadd.auto import recompute
from offloadd.auto.discover import find_blocks
from offloadd.runtime.compiled import unseen

__all__ = ["PlannedModel"]

log = logging.getLogger("offloadd")


def _weakly(method: Any) -> Any:
    """A module hook calling ``method`` while its planner lives: a model outlives the Offloader
    that planned it, and must not keep it (or what it learned) alive."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = ref()
        return bound(*args) if bound is not None else None

    return unseen(hook)  # see [planned blocks under compile] in recompute.py


class PlannedModel:
    """The model and its blocks: ``names``, ``modules``, ``index`` (a block's number by the
    id of its module). The model and its blocks are held weakly, so that one the script
    replaces (a checkpoint loaded into a new model, the next trial of a search) goes, weights
    and all, and the next model called is planned afresh."""

    def __init__(self) -> None:
        self._root: weakref.ref[nn.Module] | None = None
        self.names: list[str] = []
        self.modules: list[weakref.ref[nn.Module]] = []  # weakly too: blocks hold no parent
        self.index: dict[int, int] = {}
        self._handles: list[Any] = []
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def root(self) -> nn.Module | None:
        return self._root() if self._root is not None else None

    @property
    def gone(self) -> bool:
        """A model was planned, and nothing holds it any more."""
        return self._root is not None and self._root() is None

    def hook(self, root: nn.Module, planner: Any) -> bool:
        """Plan ``root``: find its blocks and give each the planner's hooks and its recompute
        wrapper (see [recompute wrapper] in recompute.py); False if it has none."""
        self._root = weakref.ref(root)
        found = find_blocks(root)
        if not found:
            log.warning(
                "offloadd: budget: %s has no blocks to plan; offloading as usual",
                type(root).__name__,
            )
            return False
        for k, (name, m) in enumerate(found):
            self.names.append(name)
            self.modules.append(weakref.ref(m))
            self.index[id(m)] = k
            self._handles.append(
                m.register_forward_pre_hook(_weakly(planner._pre), with_kwargs=True)
            )
            self._handles.append(m.register_forward_hook(_weakly(planner._post), always_call=True))
            recompute.install(m, planner, k)
        # an Offloader dropped without close(); detached by unhook, so that a model the planner
        # let go leaves no finalizer (holding this object) behind for the planner's lifetime
        self._finalizer = weakref.finalize(planner, self.unhook)
        log.info(
            "offloadd: budget: %d blocks found (%s ... %s)", len(found), found[0][0], found[-1][0]
        )
        return True

    def unhook(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        for h in self._handles:
            h.remove()
        self._handles = []
        for ref in self.modules:
            if (m := ref()) is not None:
                recompute.remove(m)
