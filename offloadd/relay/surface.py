"""Relay as users call it: :func:`relay`, :func:`unrelay`, :func:`relay_stats` (and
:func:`~offloadd.relay.model_ops.resident`); the hooks that run it."""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offloadd.config import Config
from offloadd.relay import handed
from offloadd.relay.checkpoint import Checkpoint
from offloadd.relay.groups import Group, find_groups, write_group
from offloadd.relay.loading import (
    Slots,
    as_dtype,
    make_relayed_real,
    match,
    materialize,
    relayed_keys,
    stream_group,
)
from offloadd.relay.model_ops import hook_model_ops, resident, unpatch
from offloadd.relay.placeholder import RelayError
from offloadd.relay.relayer import Relay
from offloadd.relay.release import take_back
from offloadd.relay.slabs import Slabs
from offloadd.relay.state import ATTR, RelayState, is_relayed, state_of
from offloadd.relay.store import HostStore, WeightStore, open_store
from offloadd.runtime.compiled import unseen
from offloadd.runtime.heap_trim import malloc_trim
from offloadd.runtime.shutdown import moved_off_engine_thread
from offloadd.runtime.stages import HELD_ELSEWHERE

__all__ = [
    "RelayStats",
    "forward_begun",
    "is_relayed",
    "keep_final_stats",
    "relay",
    "relay_stats",
    "resident",
    "unrelay",
]

log = logging.getLogger("offloadd")

MIN_GROUP_BYTES = 64 << 10


@dataclass(frozen=True, kw_only=True)
class RelayStats:
    """What relay holds and moves (bytes; ``wait_s`` in seconds). ``swaps``: the groups
    brought in for use, each time (swapped in for a forward, a use or a load; brought back for a
    backward, read or kept from forward alike)."""

    relayed_bytes: int
    resident_bytes: int
    peak_resident_bytes: int
    read_bytes: int
    written_bytes: int
    wait_s: float
    groups: int
    kept: tuple[str, ...]
    swaps: int = 0


def relay(
    model: nn.Module,
    *,
    window: int | None = None,
    config: Config | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str | None = None,
    ignore_keys: Sequence[str] = (),
    **overrides: Any,
) -> nn.Module:
    """Relay ``model``'s frozen weights through the store (Note [relay groups]); returns it.

    ``window``: groups held at once (default ``config.relay_window``); ``config`` (default:
    ``Config.from_env()``) with ``overrides`` applied says the tier and the directories.
    ``checkpoint``: a safetensors file, index or directory to load a model built on the meta
    device from, group by group (Note [loading from a checkpoint] in loading.py), its floating
    tensors in ``dtype`` if given; ``ignore_keys``: patterns of checkpoint keys the model may
    lack."""
    if is_relayed(model):
        raise RelayError("offloadd relay: this model is relayed already")
    cfg = config if config is not None else Config.from_env()
    if overrides:
        cfg = cfg.replace(**overrides)
    win = cfg.relay_window if window is None else window
    if win < 1:
        raise RelayError(f"relay_window: at least 1 group must be held, got {win}")
    if checkpoint is None:
        if dtype is not None:
            raise RelayError("offloadd relay: dtype= converts a checkpoint as it loads: give one")
        return _relay(model, cfg, win, None, None)
    with Checkpoint(checkpoint) as ckpt:
        slots = match(model, ckpt, as_dtype(dtype), ignore_keys)
        return _relay(model, cfg, win, ckpt, slots)


def _relay(
    model: nn.Module, cfg: Config, win: int, ckpt: Checkpoint | None, slots: Slots | None
) -> nn.Module:
    groups, kept = find_groups(model, MIN_GROUP_BYTES, meta=ckpt is not None)
    _refuse_dtensors(groups)
    keys: dict[int, list[str]] = {}
    if ckpt is not None:
        assert slots is not None
        keys = {g.index: relayed_keys(slots, g) for g in groups}
        materialize(slots, ckpt, {id(e.param) for g in groups for e in g.entries})
        make_relayed_real(slots, groups)
    devices = list(dict.fromkeys(e.param.device for g in groups for e in g.entries))
    if len(devices) > 1:  # a model split across devices (device_map="auto", pipeline stages)
        raise RelayError(
            "offloadd relay: the frozen weights are on several devices "
            f"({', '.join(map(str, devices))}); relay takes a model whose frozen weights share "
            "one device: relay each device's part as its own module"
        )
    device = devices[0] if devices else None
    store = open_store(cfg, device, max((g.nbytes for g in groups), default=0))
    # Staged in slabs, not torch's allocator: freeing a 10 MiB buffer would raise glibc's mmap
    # threshold to 10 MiB, and training's activations below it would then fragment its heap.
    r = Relay(model, groups, store, win, Slabs(keep=win + 1))
    try:
        for g in groups:
            if ckpt is not None:
                stream_group(r, g, keys[g.index], ckpt)
            else:
                write_group(r, g, [e.param for e in g.entries])
    except BaseException:
        store.close()
        raise
    r.slabs.reset_peak()
    for g in groups:
        for e in g.entries:
            e.module._parameters[e.attr] = e.placeholder
            e.param.data = torch.empty(0, dtype=e.dtype, device=e.param.device)
    if groups and (trim := malloc_trim()) is not None:
        trim(0)  # the weights' storages went back to glibc's heap: give the pages back too
    state = RelayState(r, win, cfg, kept)
    _hook(model, state)
    model.__dict__[ATTR] = state
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        # torch.compile(model)'s wrapper: its hooks run outside the compiled frame, never warn
        _compiled_whole(weakref.ref(model))
    HELD_ELSEWHERE.declare(model, r.held_for_budget)
    # a model dropped without unrelay: its store's engine stops, its files (no names) close
    state.finalizer = weakref.finalize(model, _close, store, r.slabs)
    return model


def _refuse_dtensors(groups: list[Group]) -> None:
    """A sharded weight (FSDP2's ``fully_shard``, tensor parallel) is a DTensor: what its rank
    holds is one shard, and FSDP2 gathers the weights from buffers of its own, which relay
    cannot swap. Refused by name, before anything is written."""
    for g in groups:
        for e in g.entries:
            if any(c.__name__ == "DTensor" for c in type(e.param).__mro__):
                raise RelayError(
                    f"offloadd relay: the frozen weight {e.name!r} is a DTensor (FSDP2's "
                    "fully_shard or tensor parallel); relay takes a model whose frozen weights "
                    "are plain tensors. FSDP2 already holds 1/world of each frozen weight per "
                    "rank (its CPUOffloadPolicy keeps them in host memory); relay a model that "
                    "is not sharded, or wrapped by DDP"
                )


def _close(store: WeightStore | HostStore, slabs: Slabs) -> None:
    if moved_off_engine_thread(_close, store, slabs, name="offloadd-relay-close"):
        return
    store.close()
    slabs.close()


def _hook(model: nn.Module, state: RelayState) -> None:
    r = state.relay
    h = state.handles
    warn = functools.partial(_compiled_whole, weakref.ref(model))  # a cycle through the hook
    state.model_pre = unseen(functools.partial(_on_model_forward, state), warn, modes_aside=True)
    h.append(model.register_forward_pre_hook(state.model_pre))
    h.append(
        model.register_forward_hook(
            unseen(r.after_model_forward, modes_aside=True), always_call=True
        )
    )
    for g in r.groups:
        pre, post = (
            functools.partial(r.on_group_forward, g),
            functools.partial(r.after_group_forward, g),
        )
        h.append(g.module.register_forward_pre_hook(unseen(pre, modes_aside=True)))
        h.append(g.module.register_forward_hook(unseen(post, modes_aside=True), always_call=True))
    hook_model_ops(model, state)
    # pickle and deepcopy look these up on the instance: say why, before they meet a hook
    model.__dict__["__reduce_ex__"] = _not_copied
    model.__dict__["__deepcopy__"] = _not_copied


def _on_model_forward(state: RelayState, module: nn.Module, args: Any) -> None:
    if state.handed and not state.relay.depth:
        handed.write_through(state)  # Note [handed-out values]
    state.relay.on_model_forward(module, args)


def forward_begun(model: nn.Module) -> None:
    """Run relay's model pre-hook for a call of ``model`` already under way: one relayed by a
    global forward pre-hook of that very call (``OFFLOADD_RELAY=frozen``), for which torch had
    gathered the model's own pre-hooks before relay registered its one. Its forward hook is
    gathered after the forward, and runs."""
    state_of(model).model_pre(model, ())


def _compiled_whole(model_ref: weakref.ref[nn.Module]) -> None:
    """Note [relay under torch.compile]: relay's hooks run eagerly, so a model compiled whole
    breaks its graph at each relayed layer. Inductor then compiles the layers apart, as
    ``layer.compile()`` per layer would, and its kernels round as those do: the same bits as
    the unrelayed model compiled per layer, not as the one compiled whole. Said once."""
    model = model_ref()
    state = model.__dict__.get(ATTR) if model is not None else None
    if state is None or state.compile_warned:
        return
    state.compile_warned = True
    log.warning(
        "offloadd relay: %s is compiled whole (torch.compile(model)): relay reads each "
        "layer's weights in eagerly, a graph break at each relayed layer, so the compiled "
        "kernels are those of the model compiled per layer and the losses differ in their last "
        "bits from the unrelayed model compiled whole; compile per layer "
        "(`layer.compile()` for each layer) for the same bits with and without relay",
        type(getattr(model, "_orig_mod", model)).__name__,
    )


def _not_copied(*args: Any) -> Any:
    raise RelayError(
        "offloadd relay: a relayed model cannot be pickled or deep-copied (its frozen weights "
        "are in the store): save or copy its state_dict(), or call offloadd.unrelay(model) first"
    )


def unrelay(model: nn.Module) -> nn.Module:
    """Put every relayed weight back in memory (the same parameter objects), and close the store."""
    state = state_of(model)
    r = state.relay
    r.settle()  # Note [between steps]: a group a backward that raised left in, out first
    handed.write_through(state)
    state.handed.clear()  # the weights are the model's own again: the values copies
    for g in r.groups:
        if not g.released:
            take_back(r, g)
    unpatch(state)
    for name in ("__reduce_ex__", "__deepcopy__", ATTR):
        model.__dict__.pop(name, None)
    HELD_ELSEWHERE.forget(model)
    state.finalizer()
    return model


def relay_stats(model: nn.Module, *, reset_peak: bool = False) -> RelayStats:
    """What ``model``'s relay holds and moved; ``reset_peak`` starts the peak again from now."""
    state = state_of(model)
    st = _stats(*_sources(state))
    if reset_peak:
        state.relay.slabs.reset_peak()
    return st


def keep_final_stats(model: nn.Module, into: list[RelayStats]) -> weakref.finalize[Any, Any]:
    """Append ``model``'s :func:`relay_stats` to ``into`` when the model is dropped (the exit
    report of ``OFFLOADD_RELAY=frozen`` outlives a script's models). Returns the finalizer:
    calling it appends them now, once (at exit, for a model alive, unrelayed since or not)."""
    fin = weakref.finalize(model, _final, into, *_sources(state_of(model)))
    fin.atexit = False  # the exit report calls it, before the report is written
    return fin


def _final(into: list[RelayStats], *args: Any) -> None:
    into.append(_stats(*args))


def _sources(
    state: RelayState,
) -> tuple[WeightStore | HostStore, Slabs, int, int, list[str]]:
    """What :func:`_stats` reads, none of it the model (a finalizer's arguments outlive it)."""
    r = state.relay
    live = [g for g in r.groups if not g.released]
    return r.store, r.slabs, sum(g.nbytes for g in live), len(live), list(state.kept)


def _stats(
    store: WeightStore | HostStore, slabs: Slabs, nbytes: int, groups: int, kept: list[str]
) -> RelayStats:
    return RelayStats(
        relayed_bytes=nbytes,
        resident_bytes=slabs.held_bytes,
        peak_resident_bytes=slabs.peak_bytes,
        read_bytes=store.read_bytes,
        written_bytes=store.written_bytes,
        wait_s=store.wait_s,
        groups=groups,
        kept=tuple(kept),
        swaps=store.swaps,
    )
