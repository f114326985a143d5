"""What relay moves, and together: :func:`find_groups`.

Note [relay groups]
~~~~~~~~~~~~~~~~~~~
A group is what is read in at once: a layer (each child of the model's outermost
``ModuleList``: the decoder layers of a transformer, the blocks of a ResNet stage list), or,
outside the layers, one module with frozen weights of its own (an embedding, a head). Its frozen
weights are laid out in one record, each storage at a 64-byte-aligned offset, and come back as
views of one slab with the strides and storage offsets they had (the kernels then see the same
layout, and compute the same bits).

A weight stays resident (and is reported as kept) when relaying it could change what another
part of the model sees:
- its storage is shared with a trainable parameter, a buffer or a weight of another group (tied
  weights: an embedding tied to the head, views into one flat buffer);
- its group holds fewer than ``min_bytes`` (a lone frozen LayerNorm: the read would cost more
  than the bytes saved).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from offloadd.io.buffers import round_up
from offloadd.relay.placeholder import RelayedWeight

__all__ = ["Entry", "Group", "find_groups", "lay_out", "view_of", "write_group"]

ALIGN = 64


@dataclass(eq=False)
class Entry:
    """One relayed weight: where it is registered and where it lies in its group's slab."""

    module: nn.Module
    attr: str
    name: str
    param: nn.Parameter
    placeholder: RelayedWeight
    offset: int  # storage offset of the view in the slab, in elements of its dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    version: int = 0  # its version counter, and the address of its first byte, as installed
    address: int = 0

    def covers(self, byte: int) -> bool:
        """Whether the weight's view covers ``byte`` of the slab."""
        size = self.dtype.itemsize
        start = self.offset * size
        if 0 in self.size:
            return False
        last = sum((n - 1) * st for n, st in zip(self.size, self.stride, strict=True))
        return start <= byte < start + (last + 1) * size


@dataclass(eq=False)
class Group:
    index: int
    name: str
    module: nn.Module
    entries: list[Entry] = field(default_factory=list)
    nbytes: int = 0
    generation: int = 0
    record: object = None  # the store's Record
    released: bool = False  # made resident for good (Note [made resident] in release.py)
    layout: tuple[tuple[Any, ...], ...] = ()  # its entries' views: a key for the views a slab keeps

    def view(self, slab: torch.Tensor, e: Entry) -> torch.Tensor:
        return view_of(slab, (e.dtype, e.offset, e.size, e.stride))

    def views_of(self, slab: torch.Tensor) -> list[torch.Tensor]:
        """Each entry's view of ``slab``, in entry order."""
        return [view_of(slab, geometry) for geometry in self.layout]


def view_of(slab: torch.Tensor, geometry: tuple[Any, ...]) -> torch.Tensor:
    """A new tensor on ``slab``'s storage of ``geometry``: (dtype, storage offset, sizes,
    strides)."""
    dtype, offset, size, stride = geometry
    return torch.empty(0, dtype=dtype, device=slab.device).set_(
        slab.untyped_storage(), offset, size, stride
    )


def lay_out(group: Group, tensors: list[torch.Tensor]) -> None:
    """Place ``tensors`` (the group's weights, in entry order) in one slab: each storage once,
    at a 64-byte-aligned offset, each weight with its own strides and storage offset."""
    offsets: dict[int, int] = {}
    pos = 0
    for e, t in zip(group.entries, tensors, strict=True):
        st = t.untyped_storage()
        key = st._cdata
        if key not in offsets:
            offsets[key] = pos
            pos += round_up(st.nbytes(), ALIGN)
        e.offset = offsets[key] // t.element_size() + int(t.storage_offset())
        e.size, e.stride, e.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
    group.nbytes = pos
    group.layout = tuple((e.dtype, e.offset, e.size, e.stride) for e in group.entries)


def _layer_roots(model: nn.Module) -> set[nn.Module]:
    """The children of the outermost ``ModuleList``s; a child that is itself a container (a
    ``ModuleList`` of ``ModuleList``s, iterated rather than called) gives its children."""
    roots: set[nn.Module] = set()

    def take(m: nn.Module) -> None:
        if isinstance(m, nn.ModuleList | nn.ModuleDict):
            for child in m.children():
                take(child)
        else:
            roots.add(m)

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                take(child)
            else:
                walk(child)

    walk(model)
    return roots


def _owners(
    model: nn.Module, roots: set[nn.Module]
) -> tuple[dict[nn.Module, nn.Module], set[nn.Module]]:
    """Each module's group root, and the modules reachable from two roots (shared: resident).

    Inside a layer, the layer; outside the layers, the largest subtree that holds the module and
    no layer (a standalone attention module whose projection's forward is never called, an
    embeddings module whose parent reads its weights): called as a whole, it is one group."""
    owner: dict[nn.Module, nn.Module] = {}
    shared: set[nn.Module] = set()
    for root in roots:
        for sub in root.modules():
            if owner.setdefault(sub, root) is not root:
                shared.add(sub)
    holds_layer: set[nn.Module] = set()

    def mark(m: nn.Module) -> bool:
        found = m in roots
        for child in m.children():
            found = mark(child) or found
        if found:
            holds_layer.add(m)
        return found

    mark(model)

    def assign(m: nn.Module, top: nn.Module | None) -> None:
        if m in roots:
            return
        here = top if top is not None else (m if m not in holds_layer else None)
        if here is not None:
            owner.setdefault(m, here)
        for child in m.children():
            assign(child, here)

    assign(model, None)
    return owner, shared


def find_groups(
    model: nn.Module, min_bytes: int, meta: bool = False
) -> tuple[list[Group], list[str]]:
    """The groups of ``model``'s frozen weights, and the names of frozen weights kept resident;
    ``meta``: weights on the meta device count too (a model loaded from a checkpoint)."""
    roots = _layer_roots(model)
    owner_group, shared = _owners(model, roots)
    # a module reached twice (a layer used twice: ModuleList([a, b, a])) is one module, named
    # by its first place, its weights relayed once: a group called twice in one forward
    names = dict(reversed([(id(m), n) for n, m in model.named_modules(remove_duplicate=False)]))
    # who uses each storage: the groups of frozen weights, or None for anything else
    users: dict[int, set[object]] = {}
    frozen: list[tuple[nn.Module, str, nn.Parameter, nn.Module | None]] = []
    for _, m in model.named_modules():
        for attr, p in m._parameters.items():
            if p is None or isinstance(p, RelayedWeight) or (p.is_meta and not meta):
                continue
            key = p.untyped_storage()._cdata
            if p.requires_grad or p.layout is not torch.strided or m in shared:
                users.setdefault(key, set()).add(None)
                if not p.requires_grad:
                    frozen.append((m, attr, p, None))  # listed as kept below
                continue
            g = owner_group.get(m, m)
            users.setdefault(key, set()).add(g)
            frozen.append((m, attr, p, g))
        for b in m._buffers.values():
            if b is not None and (meta or not b.is_meta):
                users.setdefault(b.untyped_storage()._cdata, set()).add(None)
    kept: list[str] = []
    by_group: dict[nn.Module, list[tuple[nn.Module, str, nn.Parameter]]] = {}
    for m, attr, p, g in frozen:
        name = f"{names[id(m)]}.{attr}" if names[id(m)] else attr
        if g is None or len(users[p.untyped_storage()._cdata]) > 1:
            if name not in kept:
                kept.append(name)
            continue
        by_group.setdefault(g, []).append((m, attr, p))
    groups: list[Group] = []
    for g, members in by_group.items():
        group = Group(len(groups), names[id(g)] or "<root>", g)
        for m, attr, p in members:
            name = f"{names[id(m)]}.{attr}" if names[id(m)] else attr
            group.entries.append(
                Entry(m, attr, name, p, RelayedWeight.make(p, name), 0, (), (), p.dtype)
            )
        lay_out(group, [p for _, _, p in members])
        pos = group.nbytes
        if pos < min_bytes:
            kept.extend(e.name for e in group.entries)
            continue
        group.index = len(groups)
        groups.append(group)
    return groups, kept


class _Writes(Protocol):
    """What :func:`write_group` needs of a relay (:class:`~offloadd.relay.relayer.Relay`)."""

    slabs: Any
    store: Any


def write_group(r: _Writes, g: Group, tensors: list[torch.Tensor]) -> None:
    """Write ``tensors`` (``g``'s weights, laid out as its entries say) as ``g``'s new record."""
    slab = r.slabs.take(g.nbytes, writable=True)
    for e, t in zip(g.entries, tensors, strict=True):
        g.view(slab, e).copy_(t.detach().cpu())
    g.record = r.store.write(g.name, slab)
