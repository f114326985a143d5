"""Relay from a checkpoint: a model built without its weights, filled group by group.

Note [loading from a checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``relay(model, checkpoint=path)`` takes a model whose parameters are on the meta device (built
within :func:`weights_on_meta`, accelerate's ``init_empty_weights()``, or ``torch.device("meta")``
where it has no buffers computed at init), trainable ones marked as the user wants. Before a byte
is written it matches the model to the checkpoint, as ``load_state_dict(strict=True)`` would:
each parameter and persistent buffer by its ``state_dict`` key; a tensor registered under
several keys (tied weights) needs one of them; a key the model lacks, a tensor without a value
or a shape that differs is an error naming the keys. Then:

- each relayed group's weights are read from the file into one slab and written as its record,
  a group at a time (the slab goes back to the pool), so what the load holds is a few groups
  above what stays in memory;
- everything else (trainable parameters, frozen weights kept resident, buffers) is made in
  memory with its values; a tensor registered twice stays one tensor (a tie is kept);
- values are converted to the dtype of the model's tensor (``dtype=`` sets the floating ones').

The relayed weights are new parameters (a meta tensor's ``.data`` cannot become a CPU one), made
before the optimizer sees the model; the placeholders say the device they load to (the CPU).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from offloadd.relay.checkpoint import Checkpoint, CheckpointError
from offloadd.relay.groups import Group
from offloadd.relay.placeholder import RelayError

__all__ = [
    "Slots",
    "as_dtype",
    "make_relayed_real",
    "match",
    "materialize",
    "relayed_keys",
    "stream_group",
    "weights_on_meta",
]

CPU = torch.device("cpu")


@contextlib.contextmanager
def weights_on_meta() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers real (their
    values are computed at init, and are not all in a checkpoint): the model to give
    ``relay(model, checkpoint=...)``."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            meta = p.to("meta")
            module._parameters[name] = type(p)(meta, requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@dataclass
class Slots:
    """A model's tensors against a checkpoint: each tensor object (by id), its places
    (module, table, attribute), the key it is read from, and the dtype it is made in."""

    places: dict[int, list[tuple[nn.Module, str, str]]] = field(default_factory=dict)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    key: dict[int, str] = field(default_factory=dict)
    dtype: dict[int, torch.dtype] = field(default_factory=dict)


def match(
    model: nn.Module, ckpt: Checkpoint, dtype: torch.dtype | None, ignore: Sequence[str] = ()
) -> Slots:
    """Match ``model``'s parameters and persistent buffers to ``ckpt``'s keys (see Note
    [loading from a checkpoint]); raises naming every key that does not match. ``ignore``:
    patterns (``re.search``) of checkpoint keys the model may lack (transformers'
    ``_keys_to_ignore_on_load_unexpected``)."""
    s = Slots()
    names: dict[int, list[str]] = {}
    meta_unsaved: list[str] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for table in ("_parameters", "_buffers"):
            for attr, t in getattr(module, table).items():
                if t is None:
                    continue
                key = f"{prefix}.{attr}" if prefix else attr
                if table == "_buffers" and attr in module._non_persistent_buffers_set:
                    if t.is_meta:
                        meta_unsaved.append(key)
                    continue
                s.places.setdefault(id(t), []).append((module, table, attr))
                s.tensors[id(t)] = t
                names.setdefault(id(t), []).append(key)
    if meta_unsaved:
        raise RelayError(
            "offloadd relay: buffers that no checkpoint holds are on the meta device, so their "
            f"values are lost: {', '.join(meta_unsaved)}; build the model within "
            "`offloadd.relay.weights_on_meta()` (or accelerate's `init_empty_weights()`), which "
            "leave buffers real"
        )
    missing: list[str] = []
    for i, keys in names.items():
        found = next((k for k in keys if k in ckpt.tensors), None)
        if found is None:
            missing.append(" = ".join(keys))
            continue
        s.key[i] = found
        t = s.tensors[i]
        s.dtype[i] = dtype if dtype is not None and t.is_floating_point() else t.dtype
    expected = {k for keys in names.values() for k in keys}
    unexpected = sorted(
        k for k in ckpt.tensors if k not in expected and not any(re.search(p, k) for p in ignore)
    )
    wrong = [
        f"{s.key[i]}: {list(ckpt.tensors[s.key[i]].shape)} in the checkpoint, "
        f"{list(s.tensors[i].shape)} in the model"
        for i in s.key
        if ckpt.tensors[s.key[i]].shape != tuple(s.tensors[i].shape)
    ]
    kinds = [
        f"{s.key[i]}: {ckpt.tensors[s.key[i]].dtype} in the checkpoint, "
        f"{s.tensors[i].dtype} in the model"
        for i in s.key
        if _kind(ckpt.tensors[s.key[i]].dtype) != _kind(s.tensors[i].dtype)
    ]
    problems = []
    if kinds:  # floating to floating converts (dtype=); across kinds it would not be a load
        problems.append(f"dtypes of another kind: {'; '.join(kinds)}")
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not the model: {', '.join(unexpected)}")
    if wrong:
        problems.append(f"shapes that differ: {'; '.join(wrong)}")
    if problems:
        raise CheckpointError(
            f"offloadd relay: the model does not match {str(ckpt.path)!r} ("
            + "; ".join(problems)
            + ")"
        )
    _cast_meta(s)
    return s


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "bool" if dtype == torch.bool else "integer"


def _cast_meta(s: Slots) -> None:
    """A tensor to be made in another dtype (``dtype=``) becomes a meta tensor of that dtype
    now, in each of its places (its values come from the checkpoint): relay lays out its groups
    by the model's tensors, a real one's included."""
    for i in [i for i, t in s.tensors.items() if t.dtype != s.dtype[i]]:
        t = s.tensors.pop(i)
        meta = torch.empty_strided(t.shape, t.stride(), dtype=s.dtype.pop(i), device="meta")
        new = type(t)(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        j = id(new)
        s.tensors[j], s.dtype[j] = new, new.dtype
        s.key[j], s.places[j] = s.key.pop(i), s.places.pop(i)
        for module, table, attr in s.places[j]:
            getattr(module, table)[attr] = new


def materialize(s: Slots, ckpt: Checkpoint, relayed: set[int]) -> None:
    """Give every tensor of ``s`` but the ``relayed`` its checkpoint's values, in memory, in
    each of its places (one new tensor for a tied one)."""
    with torch.no_grad():
        for i, t in s.tensors.items():
            if i in relayed:
                continue
            dtype = s.dtype[i]
            if t.is_meta or t.dtype != dtype:
                # the strides the model was built with (a transposed weight's too)
                new = torch.empty_like(t, dtype=dtype, device=CPU if t.is_meta else t.device)
                _read(ckpt, s.key[i], new)
                made: torch.Tensor = (
                    type(t)(new, requires_grad=t.requires_grad)
                    if isinstance(t, nn.Parameter)
                    else new
                )
                for module, table, attr in s.places[i]:
                    getattr(module, table)[attr] = made
            else:
                _read(ckpt, s.key[i], t)


def _read(ckpt: Checkpoint, key: str, out: torch.Tensor) -> None:
    if out.device.type == "cpu":
        ckpt.read_into(key, out)
    else:  # a model part built on a GPU already
        host = torch.empty(out.shape, dtype=out.dtype)
        ckpt.read_into(key, host)
        out.copy_(host)


def make_relayed_real(s: Slots, groups: list[Group]) -> None:
    """Each relayed weight's new parameter (on the CPU, no bytes yet; Note [loading from a
    checkpoint]), put in its place; its placeholder loads to the CPU."""
    made: dict[int, nn.Parameter] = {}  # one weight in two modules of a group: one parameter
    for g in groups:
        for e in g.entries:
            old = e.param
            if not old.is_meta:
                continue
            new = made.get(id(old))
            if new is None:
                new = made[id(old)] = nn.Parameter(
                    torch.empty(0, dtype=e.dtype), requires_grad=False
                )
            e.param = new
            e.module._parameters[e.attr] = new
            e.placeholder.real_device = CPU


def stream_group(r: Any, g: Group, keys: list[str], ckpt: Checkpoint) -> None:
    """Read ``g``'s weights from ``ckpt`` into one slab of relay ``r``'s and write it as ``g``'s
    record (:func:`~offloadd.relay.groups.write_group`, reading instead of copying)."""
    slab = r.slabs.take(g.nbytes, writable=True)
    with torch.no_grad():
        for e, key in zip(g.entries, keys, strict=True):
            ckpt.read_into(key, g.view(slab, e))
    g.record = r.store.write(g.name, slab)


def relayed_keys(s: Slots, g: Group) -> list[str]:
    """The checkpoint key of each of ``g``'s weights (before :func:`make_relayed_real`)."""
    return [s.key[id(e.param)] for e in g.entries]


def as_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype=`` as given: a torch dtype, its name (``"bfloat16"``), or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise RelayError(f"offloadd relay: dtype: {dtype!r} is not a torch dtype")
