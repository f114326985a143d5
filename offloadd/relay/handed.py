"""The values ``state_dict()`` hands out for relayed weights, kept in step with the store.

Note [handed-out values]
~~~~~~~~~~~~~~~~~~~~~~~~
In PyTorch a ``state_dict()`` value shares its parameter's storage: a write into it changes the
model (``sd[k].copy_(new)``, ``v.mul_(decay)``: EMA updates, weight surgery), and a load into
the model shows in it. A relayed weight's value is a copy of the store's bytes (one tensor per
weight, see [relay surface] in model_ops.py), so relay keeps the two in step instead:

- each value handed out is noted with its version counter: a detached alias of it (which
  shares the counter and the storage) and a weak reference to it. Once the value is freed (a
  ``torch.save(model.state_dict())``, a loop over a state dict made for it), the alias goes
  too, unless the value was written into: its write then still reaches the model, as it would
  have in PyTorch, at the next check;
- before anything reads or changes the relayed weights (the model's forward, a
  ``state_dict()`` of the model or of a part of it, a load, ``resident()``, ``unrelay()``,
  ``.to()``), a value whose version moved was written into: its group is written again with it
  (:func:`write_through`), and its generation bumped, so a reference saved for backward before
  raises as after a load. A write the store refuses raises ``RelayError`` naming the weights, the
  model keeps its old ones, and it is tried again at the next check;
- within one ``state_dict()`` a weight has one value, as in PyTorch: a layer listed twice
  (``ModuleList([a, b, a])``) gives both names the same tensor;
- a load or a ``resident()`` block that changed a group copies the new weights into the values
  handed out for it (:func:`refresh`); a load with ``assign=True`` puts new tensors in, and the
  values held before are parted from the model, as PyTorch's would be;
- a conversion that changes something (``.to(dtype)``) gives the weights new tensors, as
  PyTorch does, and the values handed out before are no longer the model's (:func:`forget`); a
  conversion that changes nothing (``.to("cpu")`` on the CPU) keeps them;
- a value made under ``inference_mode`` has no version counter, and is not watched.

A write into a value is seen by its version counter, so a write that bypasses it (through
``.data``, or by a system call into its memory) is not; PyTorch's own state dicts see those.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from offloadd.relay.groups import Entry, Group, write_group
from offloadd.relay.placeholder import RelayError
from offloadd.relay.state import RelayState

__all__ = ["forget", "note", "refresh", "write_through"]


class _Handed:
    """One value handed out: a detached alias of it (its storage and version counter), and
    whether the value itself is gone (its weak reference's callback)."""

    __slots__ = ("__weakref__", "alias", "entry", "ref", "version")

    def __init__(self, e: Entry, value: torch.Tensor) -> None:
        self.entry = e
        self.alias: torch.Tensor | None = value.detach()  # shares the version counter
        self.version = value._version
        me = weakref.ref(self)
        self.ref = weakref.ref(value, lambda _: _dropped(me))

    def pending(self) -> tuple[torch.Tensor, int] | None:
        """The alias and the version the value was written into at, if it was since it was last
        written through (the alias kept until then, its value freed or not)."""
        alias = self.alias
        if alias is None or alias._version == self.version:
            return None
        return alias, alias._version


def _dropped(me: weakref.ref[_Handed]) -> None:
    """The value was freed: unless it was written into, its alias goes now (its memory with it);
    a written one waits for the next :func:`write_through`. Runs wherever the value died (any
    thread, inside a collection): it only drops a reference."""
    h = me()
    if h is not None and h.alias is not None and h.alias._version == h.version:
        h.alias = None


def note(state: RelayState, g: Group, e: Entry, value: torch.Tensor) -> None:
    """``value`` was handed out by ``state_dict()`` for weight ``e`` of group ``g`` (not one
    made under ``inference_mode``: an inference tensor has no version counter to watch)."""
    if not value.is_inference():
        state.handed.setdefault(g.index, []).append(_Handed(e, value))


def _prune(state: RelayState, index: int) -> None:
    """Forget the values of group ``index`` that are freed and have nothing left to write."""
    live = [h for h in state.handed.get(index, ()) if h.ref() is not None or h.pending()]
    if live:
        state.handed[index] = live
    else:
        state.handed.pop(index, None)


def write_through(state: RelayState, groups: list[Group] | None = None) -> None:
    """Write the values handed out and written into since into their groups (all, or
    ``groups``): see [handed-out values]. A write that fails raises, naming the
    weights, and is tried again at the next check (the values stay noted as unwritten)."""
    if not state.handed:
        return
    r = state.relay
    r.settle()  # Note [between steps]: what a backward that raised left in goes out first
    for g in r.groups if groups is None else groups:
        records = state.handed.get(g.index)
        if not records:
            continue
        changed = [(h, *p) for h in records if (p := h.pending()) is not None]
        if changed and not g.released:
            _write_values(r, g, changed)
        for h, _, v in changed:
            h.version = v
            if h.ref() is None:
                h.alias = None
        _prune(state, g.index)


def _write_values(r: Any, g: Group, changed: list[tuple[_Handed, torch.Tensor, int]]) -> None:
    with torch.no_grad():
        if g.index in r._installed:  # pinned by a load or resident(): it writes on exit
            for h, alias, _ in changed:
                h.entry.param.detach().copy_(alias)
            return
        new = {id(h.entry): alias for h, alias, _ in changed}  # the latest noted wins
        slab = r.fetch(g)
        old = g.record
        try:
            write_group(r, g, [new.get(id(e), g.view(slab, e)) for e in g.entries])
        except Exception as err:
            g.record = old
            names = ", ".join(sorted({h.entry.name for h, _, _ in changed}))
            raise RelayError(
                f"offloadd relay: writing what was written into the state_dict() values of "
                f"{names} failed ({err}); the model keeps the old weights, and the write is "
                "tried again before the model next reads them"
            ) from err
        del slab
    r.store.free(old)
    g.generation += 1


def refresh(state: RelayState, g: Group) -> None:
    """Group ``g`` was written again (a load, a ``resident()`` block): the values handed out for
    it take its new weights."""
    live = [h for h in state.handed.get(g.index, ()) if h.ref() is not None]
    if not live:
        state.handed.pop(g.index, None)
        return
    slab = state.relay.fetch(g)
    with torch.no_grad():
        for h in live:
            if h.alias is not None:
                h.alias.copy_(g.view(slab, h.entry))
                h.version = h.alias._version
    state.handed[g.index] = live


def forget(state: RelayState) -> None:
    """The weights were converted: the values handed out before are no longer theirs."""
    state.handed.clear()
