"""Relay as users meet it: :func:`relay`, :func:`unrelay`, :func:`resident`, :func:`relay_stats`.

Note [relay surface]
~~~~~~~~~~~~~~~~~~~~
What must keep working on a relayed model, and how:
- ``state_dict()``: a post-hook on each module that owns relayed weights puts their values in
  (read from the store, one copy per weight, so that savers that refuse shared storage work).
- ``load_state_dict()``: a pre-hook on each group swaps its weights in, the load copies into
  them (or, with ``assign=True``, replaces them), and a post-hook writes the group again and
  bumps its generation (refs saved before raise, see Note [relay schedule]).
- ``.to()``, ``.half()``, ``.cuda()`` on the model: its ``_apply`` unrelays, converts, and
  relays again; on a module inside it (which would convert half a group) it raises.
- ``offloadd.resident(model)``: every group swapped in for the block; weights changed inside are
  written again on exit.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offloadd.config import Config
from offloadd.io.request import on_engine_thread
from offloadd.relay.groups import Group, find_groups
from offloadd.relay.placeholder import RelayError
from offloadd.relay.relayer import Relay
from offloadd.relay.store import HostStore, WeightStore, open_store
from offloadd.runtime.compiled import unseen
from offloadd.runtime.heap_trim import malloc_trim
from offloadd.runtime.stages import HELD_ELSEWHERE

__all__ = ["RelayStats", "relay", "relay_stats", "resident", "unrelay"]

_ATTR = "_offloadd_relay"  # the model holds its relay's state: dropped with it, never kept alive

MIN_GROUP_BYTES = 64 << 10


@dataclass(frozen=True, kw_only=True)
class RelayStats:
    """What relay holds and moves (bytes; ``wait_s`` in seconds)."""

    relayed_bytes: int
    resident_bytes: int
    peak_resident_bytes: int
    read_bytes: int
    written_bytes: int
    wait_s: float
    groups: int
    kept: tuple[str, ...]


@dataclass(eq=False)
class _Relayed:
    relay: Relay
    window: int
    config: Config
    handles: list[Any]
    patched: list[nn.Module]
    kept: list[str]
    loading: set[int]
    converting: bool = False
    finalizer: Any = None


def relay(
    model: nn.Module, *, window: int | None = None, config: Config | None = None, **overrides: Any
) -> nn.Module:
    """Relay ``model``'s frozen weights through the store (Note [relay groups]); returns it.

    ``window``: groups held at once (default ``config.relay_window``); ``config`` (default:
    ``Config.from_env()``) with ``overrides`` applied says the tier and the directories."""
    if _ATTR in model.__dict__:
        raise RelayError("offloadd relay: this model is relayed already")
    cfg = config if config is not None else Config.from_env()
    if overrides:
        cfg = cfg.replace(**overrides)
    win = cfg.relay_window if window is None else window
    if win < 1:
        raise RelayError(f"relay_window: at least 1 group must be held, got {win}")
    groups, kept = find_groups(model, MIN_GROUP_BYTES)
    device = next((e.param.device for g in groups for e in g.entries), None)
    store = open_store(cfg, device)
    try:
        for g in groups:
            slab = torch.empty(g.nbytes, dtype=torch.uint8)
            for e in g.entries:
                g.view(slab, e).copy_(e.param.detach())
            g.record = store.write(g.name, slab)
    except BaseException:
        store.close()
        raise
    r = Relay(model, groups, store, win)
    state = _Relayed(r, win, cfg, [], [], kept, set())
    for g in groups:
        for e in g.entries:
            e.module._parameters[e.attr] = e.placeholder
            e.param.data = torch.empty(0, dtype=e.dtype, device=e.param.device)
    if groups and (trim := malloc_trim()) is not None:
        trim(0)  # the weights' storages went back to glibc's heap: give the pages back too
    _hook(model, state)
    model.__dict__[_ATTR] = state
    model.__dict__[HELD_ELSEWHERE] = r.held_for_budget
    # a model dropped without unrelay: its store's engine stops, its files (no names) close
    state.finalizer = weakref.finalize(model, _close, store, r.slabs)
    return model


def _close(store: WeightStore | HostStore, slabs: Any) -> None:
    if on_engine_thread():  # a collection on an engine thread: closing joins that thread
        threading.Thread(target=_close, args=(store, slabs), daemon=True).start()
        return
    store.close()
    slabs.close()


def _hook(model: nn.Module, state: _Relayed) -> None:
    r = state.relay
    h = state.handles
    h.append(model.register_forward_pre_hook(unseen(r.on_model_forward)))
    owners: dict[nn.Module, list[Any]] = {}
    for g in r.groups:
        h.append(g.module.register_forward_pre_hook(unseen(functools.partial(_pre, r, g))))
        h.append(
            g.module.register_forward_hook(unseen(functools.partial(_post, r, g)), always_call=True)
        )
        h.append(g.module.register_load_state_dict_pre_hook(functools.partial(_load_pre, state, g)))
        h.append(
            g.module.register_load_state_dict_post_hook(functools.partial(_load_post, state, g))
        )
        for e in g.entries:
            owners.setdefault(e.module, []).append((g, e))
    for m, entries in owners.items():
        h.append(m.register_state_dict_post_hook(functools.partial(_state_post, state, entries)))
    for m in {model, *owners}:
        m.__dict__["_apply"] = functools.partial(_apply, state, m, m._apply)
        state.patched.append(m)
    # pickle and deepcopy look these up on the instance: say why, before they meet a hook
    model.__dict__["__reduce_ex__"] = _not_copied
    model.__dict__["__deepcopy__"] = _not_copied


def _not_copied(*args: Any) -> Any:
    raise RelayError(
        "offloadd relay: a relayed model cannot be pickled or deep-copied (its frozen weights "
        "are in the store): save or copy its state_dict(), or call offloadd.unrelay(model) first"
    )


def _pre(r: Relay, g: Group, module: nn.Module, args: Any) -> None:
    r.on_group_forward(g)


def _post(r: Relay, g: Group, module: nn.Module, args: Any, out: Any) -> None:
    r.after_group_forward(g)


def _state_post(
    state: _Relayed,
    entries: list[Any],
    module: nn.Module,
    sd: dict[str, Any],
    prefix: str,
    meta: Any,
) -> None:
    r = state.relay
    slabs: dict[int, torch.Tensor] = {}
    for g, e in entries:
        key = prefix + e.attr
        if key not in sd:
            continue
        slab = r._installed.get(g.index, slabs.get(g.index))
        if slab is None:
            slab = slabs[g.index] = r.fetch(g)
        sd[key] = g.view(slab, e).clone(memory_format=torch.preserve_format)


def _load_pre(state: _Relayed, g: Group, module: nn.Module, *args: Any) -> None:
    r = state.relay
    if g.index not in r._installed:
        r.install(g, r.fetch(g))
        state.loading.add(g.index)


def _load_post(state: _Relayed, g: Group, module: nn.Module, incompatible: Any) -> None:
    if g.index in state.loading:
        state.loading.discard(g.index)
        _rewrite(state, g)


def _rewrite(state: _Relayed, g: Group) -> None:
    """Write ``g`` again from its weights as they are now (swapped in), then swap it out."""
    r = state.relay
    replaced = False
    for e in g.entries:
        now = e.module._parameters[e.attr]
        if now is not e.param:  # load_state_dict(assign=True) put a new parameter there
            if now is None or tuple(now.shape) != e.size or now.dtype != e.dtype:
                raise RelayError(
                    f"offloadd relay: load_state_dict replaced {e.name!r} with a tensor of "
                    "another shape or dtype; unrelay the model first"
                )
            e.param.data = now.detach()
            e.module._parameters[e.attr] = e.param
            replaced = True
    if not replaced and all(e.param._version == e.version for e in g.entries):
        r.uninstall(g)
        return
    slab = torch.empty(g.nbytes, dtype=torch.uint8)
    for e in g.entries:
        g.view(slab, e).copy_(e.param.detach().cpu())
    old = g.record
    g.record = r.store.write(g.name, slab)
    g.generation += 1
    r.store.free(old)  # type: ignore[arg-type]
    r.uninstall(g)


def _apply(
    state: _Relayed, module: nn.Module, original: Any, fn: Any, *args: Any, **kw: Any
) -> Any:
    if state.converting:
        return original(fn, *args, **kw)
    model = state.relay.model()
    if module is not model:
        raise RelayError(
            "offloadd relay: convert the relayed model as a whole (model.to(...)), "
            "or unrelay it first: converting a part of it would split a relay group"
        )
    state.converting = True
    try:
        unrelay(model)
        out = original(fn, *args, **kw)
    finally:
        state.converting = False
    relay(model, window=state.window, config=state.config)
    return out


@contextlib.contextmanager
def resident(model: nn.Module) -> Iterator[nn.Module]:
    """Every relayed weight of ``model`` swapped in for the block (all of them held); weights
    changed inside are written to the store again on exit."""
    state = _state(model)
    r = state.relay
    mine = [g for g in r.groups if g.index not in r._installed]
    for g in mine:
        r.install(g, r.fetch(g))
    try:
        yield model
    finally:
        for g in mine:
            _rewrite(state, g)


def unrelay(model: nn.Module) -> nn.Module:
    """Put every relayed weight back in memory (the same parameter objects), and close the store."""
    state = _state(model)
    r = state.relay
    for g in r.groups:
        slab = r._installed.get(g.index)
        if slab is None:
            slab = r.fetch(g)
        r.uninstall(g)
        for e in g.entries:
            e.param.data = g.view(slab, e).clone(memory_format=torch.preserve_format)
            e.module._parameters[e.attr] = e.param
    for handle in state.handles:
        handle.remove()
    for m in state.patched:
        m.__dict__.pop("_apply", None)
    model.__dict__.pop("__reduce_ex__", None)
    model.__dict__.pop("__deepcopy__", None)
    del model.__dict__[_ATTR]
    model.__dict__.pop(HELD_ELSEWHERE, None)
    state.finalizer()
    return model


def relay_stats(model: nn.Module, *, reset_peak: bool = False) -> RelayStats:
    """What ``model``'s relay holds and moved; ``reset_peak`` starts the peak again from now."""
    state = _state(model)
    r = state.relay
    st = RelayStats(
        relayed_bytes=sum(g.nbytes for g in r.groups),
        resident_bytes=r.slabs.held_bytes,
        peak_resident_bytes=r.slabs.peak_bytes,
        read_bytes=r.store.read_bytes,
        written_bytes=r.store.written_bytes,
        wait_s=r.wait_s,
        groups=len(r.groups),
        kept=tuple(state.kept),
    )
    if reset_peak:
        r.slabs.reset_peak()
    return st


def _state(model: nn.Module) -> _Relayed:
    state = model.__dict__.get(_ATTR)
    if state is None:
        raise RelayError("offloadd relay: this model is not relayed (call offloadd.relay(model))")
    return state
