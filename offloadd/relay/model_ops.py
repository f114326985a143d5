"""What changes or reads a relayed model as a whole: ``state_dict()``, ``load_state_dict()``,
:func:`resident`, and ``.to()`` (its ``_apply``).

Note [relay surface]
~~~~~~~~~~~~~~~~~~~~
- ``state_dict()``: a post-hook on each module that owns relayed weights puts their values in,
  one copy per weight (so that savers refusing shared storage work), each group read once a
  call (the model's pre- and post-hooks clear the cache).
- ``load_state_dict()``: a pre-hook on each group (on its module and on every module inside it,
  so a load into one projection of a layer works too; the outermost load under way writes the
  group again, once) swaps its weights in and pins them, the load
  copies into them (or, with ``assign=True``, replaces them), and a post-hook writes the group
  again and bumps its generation (refs saved before raise, see Note [relay schedule]). A write
  that fails swaps the group out with its old record and raises: the store never holds half.
- ``.to()``, ``.half()``, ``.cuda()``: the model's ``_apply`` converts what is not relayed as
  usual, then each group in turn: read, convert, laid out again, written; one group in memory at
  a time, none if the conversion changes nothing. On a module inside the model it raises (it
  would convert part of a group).
- The values ``state_dict()`` handed out follow the weights, and writes into them reach the
  model, as in PyTorch: Note [handed-out values] in handed.py.
- Each of these starts from the state between steps (Note [between steps] in relayer.py): no
  group swapped in but what ``resident()`` or a load pinned.
- :func:`resident`: every group swapped in and pinned for the block; what changed is written
  again on exit. Its groups are not guarded (Note [write guard] in slabs.py): a system call
  writing into a weight would fail with EFAULT, or hang a collective; on exit each group is read
  again and compared instead.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from offloadd.relay import handed
from offloadd.relay.groups import Entry, Group, lay_out, write_group
from offloadd.relay.placeholder import RelayedWeight, RelayError
from offloadd.relay.relayer import Relay
from offloadd.relay.release import current, release
from offloadd.relay.state import RelayState, state_of

__all__ = ["hook_model_ops", "resident", "unpatch"]


def hook_model_ops(model: nn.Module, state: RelayState) -> None:
    r = state.relay
    h = state.handles
    owners: dict[nn.Module, list[tuple[Group, Entry]]] = {}
    for g in r.groups:
        for m in g.module.modules():  # a load into the layer, or into a module inside it
            h.append(m.register_load_state_dict_pre_hook(functools.partial(_load_pre, state, g)))
            h.append(m.register_load_state_dict_post_hook(functools.partial(_load_post, state, g)))
            h.append(m.register_state_dict_pre_hook(functools.partial(_state_pre_group, state, g)))
        for e in g.entries:
            owners.setdefault(e.module, []).append((g, e))
    h.append(model.register_state_dict_pre_hook(functools.partial(_state_pre, state)))
    for m, entries in owners.items():
        m.__dict__["_save_to_state_dict"] = functools.partial(_save, weakref.ref(m), entries)
        h.append(m.register_state_dict_post_hook(functools.partial(_state_post, state, entries)))
    h.append(model.register_state_dict_post_hook(functools.partial(_clear_cache, state)))
    ref = weakref.ref(state)
    for m in {model, *owners}:
        m.__dict__["_apply"] = functools.partial(_apply, ref, weakref.ref(m))
        state.patched.append(weakref.ref(m))


def unpatch(state: RelayState) -> None:
    for handle in state.handles:
        handle.remove()
    for m_ref in state.patched:
        m = m_ref()
        if m is not None:
            m.__dict__.pop("_apply", None)
            m.__dict__.pop("_save_to_state_dict", None)


def _clear_cache(state: RelayState, *args: Any) -> None:
    state.sd_cache.clear()
    state.sd_values.clear()
    state.sd_open = False


def _state_pre(state: RelayState, *args: Any) -> None:
    handed.write_through(state)
    _clear_cache(state)
    state.sd_open = True


def _state_pre_group(state: RelayState, g: Group, *args: Any) -> None:
    """A state_dict() of a module of group ``g`` (the model's own, or one of a part of it)."""
    if state.handed:
        handed.write_through(state, [g])


def _save(module_ref: Any, entries: list[tuple[Group, Entry]], *args: Any, **kw: Any) -> None:
    """The module's own ``_save_to_state_dict``, with its placeholders' ``detach()`` let through
    while it runs, and only then (a state_dict() that raises leaves none let through): the
    post-hook puts the values in."""
    module: nn.Module = module_ref()
    entries = [(g, e) for g, e in entries if not g.released]
    for _, e in entries:
        e.placeholder.relay_saving = True
    try:
        type(module)._save_to_state_dict(module, *args, **kw)
    finally:
        for _, e in entries:
            e.placeholder.relay_saving = False


def _state_post(
    state: RelayState,
    entries: list[tuple[Group, Entry]],
    module: nn.Module,
    sd: dict[str, Any],
    prefix: str,
    meta: Any,
) -> None:
    r = state.relay
    cache = state.sd_cache if state.sd_open else {}  # a part's state_dict(): nothing kept
    for g, e in entries:
        key = prefix + e.attr
        if key not in sd or g.released:  # a released group's weights are saved as they are
            continue
        seen = state.sd_values.get(id(e)) if state.sd_open else None
        if seen is not None and seen[0] == g.generation:  # a module reached twice: one value
            sd[key] = seen[1]
            continue
        if g.index in r._installed:  # swapped in: the weight as it is (a new .data included)
            sd[key] = e.param.detach().clone(memory_format=torch.preserve_format)
        else:
            held = cache.get(g.index)
            if held is None or held[0] != g.generation:
                cache.clear()  # groups come in order: one held at a time
                held = cache[g.index] = (g.generation, r.fetch(g))
            sd[key] = g.view(held[1], e).clone(memory_format=torch.preserve_format)
        if state.sd_open:
            state.sd_values[id(e)] = (g.generation, sd[key])
        handed.note(state, g, e, sd[key])


def _load_pre(state: RelayState, g: Group, module: nn.Module, *args: Any) -> None:
    r = state.relay
    r.settle()  # Note [between steps]: a group left in by a backward that raised goes out
    handed.write_through(state, [g])
    if g.index not in r._installed and not g.released:
        r.install(g, r.fetch(g))
        r.pinned.add(g.index)
        state.loading[g.index] = module  # the load that swapped it in writes it again


def _load_post(state: RelayState, g: Group, module: nn.Module, incompatible: Any) -> None:
    if state.loading.get(g.index) is module:  # its modules' loads done (theirs run first)
        del state.loading[g.index]
        state.relay.pinned.discard(g.index)
        if rewrite(state.relay, g):  # assign=True: new tensors, the values held are parted
            state.handed.pop(g.index, None)
        else:
            handed.refresh(state, g)


def rewrite(r: Relay, g: Group) -> bool:
    """Write ``g`` again from its weights as they are now (swapped in), then swap it out;
    whether a load with ``assign=True`` put new parameters in."""
    replaced = False
    for e in g.entries:
        now = e.module._parameters[e.attr]
        if now is not e.param:  # load_state_dict(assign=True) put a new parameter there
            if now is None or tuple(now.shape) != e.size or now.dtype != e.dtype:
                r.uninstall(g)
                raise RelayError(
                    f"offloadd relay: load_state_dict replaced {e.name!r} with a tensor of "
                    "another shape or dtype; unrelay the model first"
                )
            e.param.data = now.detach()
            e.module._parameters[e.attr] = e.param
            replaced = True
    slab = r._installed[g.index]
    seen = r.slabs.guarded(slab)  # else a write may have bypassed the guard: compare
    if not replaced and not r.changes(g, r.slabs.written(slab)) and (seen or _as_stored(r, g)):
        r.uninstall(g)  # unchanged: nothing to write (Note [write guard])
        return False
    old = g.record
    try:
        write_group(r, g, [e.param.detach() for e in g.entries])
    except BaseException as err:
        g.record = old
        r.uninstall(g)
        if not isinstance(err, Exception):
            raise  # an interrupt (a wait for the daemon, Ctrl-C) stays one
        raise RelayError(
            f"offloadd relay: writing the new weights of {g.name!r} failed ({err}); the "
            "store keeps the old ones, and the model uses them"
        ) from err
    g.generation += 1
    r.store.free(old)  # type: ignore[arg-type]
    r.uninstall(g)
    return replaced


def _as_stored(r: Relay, g: Group) -> bool:
    """Whether swapped-in ``g`` holds its record's bytes (read again to compare): for a group no
    guard watched, which a write by the kernel (a ``readinto``, a collective) would not fault."""
    stored = r.fetch(g)
    return torch.equal(r._installed[g.index][: g.nbytes], stored[: g.nbytes])


def _apply(state_ref: Any, module_ref: Any, fn: Any, *args: Any, **kw: Any) -> Any:
    state: RelayState = state_ref()
    module: nn.Module = module_ref()
    original = type(module)._apply.__get__(module)
    if state is None or state.converting:
        return original(fn, *args, **kw)
    r = state.relay
    r.settle()
    handed.write_through(state)
    if module is not r.model():
        raise RelayError(
            "offloadd relay: convert the relayed model as a whole (model.to(...)), "
            "or unrelay it first: converting a part of it would split a relay group"
        )
    if r._installed:
        raise RelayError("offloadd relay: convert the model outside its forward and resident()")
    hidden = [e for g in r.groups for e in g.entries]
    state.converting = True
    try:
        for e in hidden:
            e.module._parameters[e.attr] = None  # Module._apply skips them
        out = original(fn, *args, **kw)
    finally:
        for e in hidden:
            e.module._parameters[e.attr] = e.placeholder
        state.converting = False
    with torch.no_grad():
        converted = [_convert_group(r, g, fn) for g in r.groups]
    if any(converted):  # new tensors, as PyTorch's conversion makes: the values held are parted
        handed.forget(state)
    return out


def _convert_group(r: Relay, g: Group, fn: Any) -> bool:
    """Convert ``g``'s weights with ``fn``; whether anything changed."""
    probes = [torch.zeros(1, dtype=e.dtype, device=e.param.device) for e in g.entries]
    if all(fn(p) is p for p in probes):
        return False  # nothing changes: nothing to read
    slab = r.fetch(g)
    new = [fn(g.view(slab, e)) for e in g.entries]
    del slab
    old = g.record
    lay_out(g, new)
    write_group(r, g, new)
    r.store.free(old)  # type: ignore[arg-type]
    g.generation += 1
    for e, t in zip(g.entries, new, strict=True):
        e.param.data = torch.empty(0, dtype=t.dtype, device=t.device)
        r.forget_placeholder(e)
        e.placeholder = RelayedWeight.make(t, e.name)
        r.note_placeholder(g, e)
        e.module._parameters[e.attr] = e.placeholder
    r.device = new[0].device if new else r.device
    return True


@contextlib.contextmanager
def resident(model: nn.Module) -> Iterator[nn.Module]:
    """Every relayed weight of ``model`` swapped in for the block (all of them held); weights
    changed inside are written to the store again on exit."""
    state = state_of(model)
    r = state.relay
    r.settle()
    handed.write_through(state)
    mine = [g for g in r.groups if g.index not in r._installed and not g.released]
    for g in mine:
        r.install(g, r.fetch(g), guard=False)  # compared with the store on exit instead
        r.pinned.add(g.index)
    try:
        yield model
    finally:
        errors = []
        for g in mine:
            r.pinned.discard(g.index)
            if g.released:  # unfrozen through a placeholder in the block: taken already
                continue
            try:
                trained = [e.name for e in g.entries if current(e).requires_grad]
                if trained:  # unfrozen in the block: resident for good (Note [made resident])
                    release(r, g, f"{trained[0]!r} was made to require grad")
                    continue
                rewrite(r, g)
                handed.refresh(state, g)
            except RelayError as e:
                r.uninstall(g)  # swapped out whatever failed (rewrite's own errors did)
                errors.append(e)
        if errors:
            raise errors[0]
