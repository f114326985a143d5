"""Relayed weights that come to require grad: their group made resident for good.

Note [made resident]
~~~~~~~~~~~~~~~~~~~~
Relay moves frozen weights. A weight that comes to require grad after relay() (a user
unfreezing the top layers) makes its group resident for good: the group is read in once,
its weights are the model's parameters again (the same objects, with their values), its
record is freed, and relay skips it from then on; said once in the log. Asked through the
placeholder (``requires_grad_(True)`` between steps, before an optimizer is built), the real
parameter is what the call returns and what ``parameters()`` gives from then on. Asked of the
real parameter itself, it is found where the group is next swapped in: as ``resident()`` ends,
or at the group's next forward (a parameter object held from before relay()). While the model
runs it is refused: a forward or backward underway holds the group's refs. Refs saved before (a
forward whose backward has not run) meet the new generation and raise, as PyTorch's in-place
check would.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol

import torch

from offloadd.relay.groups import Group
from offloadd.relay.placeholder import RelayError

__all__ = ["Relay", "current", "release", "take_back", "unfreeze"]


class Relay(Protocol):
    """What a group's release needs of its relay (:class:`~offloadd.relay.relayer.Relay`)."""

    depth: int
    store: Any
    pinned: set[int]
    order: list[int]
    order_at: dict[int, int]
    _seen: list[int]
    _by_placeholder: dict[int, tuple[Group, Any]]
    _installed: dict[int, torch.Tensor]
    _on_demand: dict[int, int]
    _fwd: dict[int, Any]

    def fetch(self, g: Group) -> torch.Tensor: ...
    def uninstall(self, g: Group) -> list[str]: ...
    def forget_placeholder(self, e: Any) -> None: ...


log = logging.getLogger("offloadd")


def unfreeze(r: Relay, placeholder: Any) -> torch.Tensor | None:
    """The real weight behind ``placeholder``, its group made resident (Note [made
    resident]), or None if it is not one of this relay's."""
    found = r._by_placeholder.get(id(placeholder))
    if found is None:
        return None
    g, e = found
    if r.depth or torch._C._current_graph_task_id() != -1:
        raise RelayError(
            f"offloadd relay: {e.name!r} was asked to require grad while the model runs; "
            "unfreeze relayed weights between steps"
        )
    release(r, g, f"{e.name!r} was asked to require grad")
    return e.param


def release(r: Relay, g: Group, why: str) -> None:
    """Make ``g`` resident for good (Note [made resident])."""
    take_back(r, g)
    r.store.free(g.record)
    g.record = None
    g.released = True
    g.generation += 1
    log.warning(
        "offloadd relay: %s made resident (%s): %d bytes back in memory, relayed no more",
        g.name,
        why,
        g.nbytes,
    )
    g.entries = []
    g.nbytes = 0
    r._fwd.pop(g.index, None)
    r._seen = [i for i in r._seen if i != g.index]  # the next forward's order has it no more
    r.order = [i for i in r.order if i != g.index]
    r.order_at = {i: at for at, i in enumerate(r.order)}


def take_back(r: Relay, g: Group) -> None:
    """Put ``g``'s weights back in their modules, in memory: the same parameter objects, with
    the values they have where the group is swapped in (a load or a ``.data`` assignment within
    ``resident()`` included), else the store's. A placeholder kept by the user then answers
    ``requires_grad_(True)`` with its weight (Note [made resident])."""
    installed = g.index in r._installed
    if installed:
        values = [current(e).detach().clone(memory_format=torch.preserve_format) for e in g.entries]
    else:
        slab = r.fetch(g)
        values = [g.view(slab, e).clone(memory_format=torch.preserve_format) for e in g.entries]
    r.pinned.discard(g.index)
    r._on_demand.pop(g.index, None)
    r.uninstall(g)
    for e, value in zip(g.entries, values, strict=True):
        e.param.data = value
        e.module._parameters[e.attr] = e.param
        r.forget_placeholder(e)
        e.placeholder.relay_unfreeze = functools.partial(_taken_back, e.param)


def current(e: Any) -> torch.Tensor:
    """The parameter in a swapped-in weight's place now: its own, or the one
    ``load_state_dict(assign=True)`` put there (of the weight's shape and dtype)."""
    now = e.module._parameters.get(e.attr)
    if now is None or now is e.param:
        return e.param
    if tuple(now.shape) != e.size or now.dtype != e.dtype:
        raise RelayError(
            f"offloadd relay: {e.name!r} was replaced by a tensor of another shape or dtype "
            "while swapped in; unrelay the model first"
        )
    return now


def _taken_back(param: torch.Tensor, placeholder: Any) -> torch.Tensor:
    return param
