"""Backward's side of a relay: :class:`Saved` turns saved views of relayed weights into
:class:`WeightRef` s and brings their groups back in backward (Note [relay schedule] in
relayer.py)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Protocol

import torch

from offloadd.relay.groups import Group
from offloadd.relay.placeholder import RelayError
from offloadd.relay.slabs import Slabs
from offloadd.relay.store import Transfer
from offloadd.runtime.compiled import unseen
from offloadd.runtime.hook_stack import PASSES_TO, PassPack, PassUnpack
from offloadd.runtime.identity import storage_of

__all__ = ["Reader", "Saved", "WeightRef"]


class Reader(Protocol):
    """What :class:`Saved` needs of its relay (:class:`~offloadd.relay.relayer.Relay`)."""

    lock: threading.Lock
    window: int
    depth: int  # the model's forwards running
    groups: list[Group]
    order: list[int]  # the groups in the last forward's order
    order_at: dict[int, int]  # each group's place in it
    slab_group: dict[int, Group]  # the storage of a slab swapped in -> its group
    store: Any  # its ``swaps`` counts the groups brought back here too
    slabs: Slabs  # the views backward gets (Slabs.view)

    def read_ahead(self, g: Group) -> Transfer: ...
    def wait_for(self, t: Transfer) -> torch.Tensor: ...
    def fetch(self, g: Group) -> torch.Tensor: ...


Key = tuple[int, int]  # (group, forward): see Saved.forwards


class WeightRef:
    """What autograd holds for a saved view of a relayed weight (see Note [relay schedule])."""

    __slots__ = ("generation", "geometry", "group", "key", "saved", "unpacked")

    def __init__(self, saved: Saved, group: Group, t: torch.Tensor) -> None:
        self.saved = saved
        self.group = group
        self.key = (group.index, saved.forwards)  # a group's refs of one forward are held together
        self.generation = group.generation
        # dtype, storage offset, sizes, strides: the view backward gets back (Slabs.view)
        self.geometry = (t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        self.unpacked = False  # once unpacked, its key's bookkeeping has forgotten it

    def __del__(self) -> None:
        # It may run in any thread, within any allocation (a collection), even one made while
        # that thread holds the relay's lock: so it only appends (see Saved._drain).
        if not self.unpacked:
            self.saved._dead.append((self.key, id(self)))


class Saved:
    """A relay's weights saved for backward: refs, the slabs held for them, reads ahead."""

    def __init__(self, relay: Reader) -> None:
        self.relay = relay
        # Backward's bookkeeping is per (group, forward): two forwards before one backward (summed
        # micro-batches, a pair of passes) hold each group's slab for its own refs only.
        self.forwards = 0
        self._bwd_order: list[Key] = []  # keys in the order their first ref was packed
        self._bwd_at: dict[Key, int] = {}  # each key's place in it
        self._bwd: dict[Key, Transfer] = {}
        self._held: dict[Key, torch.Tensor] = {}  # slab kept for the key's pending refs
        self.carrying: dict[Key, None] = {}  # held from forward on (see carry), in carry order
        self._again: dict[Key, torch.Tensor] = {}  # read for refs unpacked again (_again_view)
        self._pending: dict[Key, set[int]] = {}  # ids of the key's refs not yet unpacked
        self._dead: deque[tuple[Key, int]] = deque()  # refs collected (finalizers only append)
        # the hooks made for the hooks below ours, kept for one model forward (Note [hooks made
        # once a forward]): (outer pack, outer unpack, our pack, our unpack)
        self._made: tuple[Any, Any, Any, Any] | None = None

    def new_forward(self) -> None:
        """The model's forward begins: its refs are a new key for each group."""
        self.forwards += 1
        with self.relay.lock:
            self._drain()
            for key in self.carrying:  # a second forward before backward: it carries its own
                self._held.pop(key, None)
            self.carrying.clear()
            self._again.clear()
        if not any(self._pending.values()):
            self._bwd_order, self._bwd_at = [], {}

    def carry(self, g: Group, slab: torch.Tensor) -> None:
        """Keep the slab of one of forward's last ``window`` groups for its refs: backward needs
        these groups first, and reading them again would start it with a wait. While forward
        runs the groups after ``g``, they and the ones carried are at most ``window``."""
        r = self.relay
        at = r.order_at.get(g.index)
        if at is None or at < len(r.order) - r.window:
            return
        if torch._C._current_graph_task_id() != -1:  # a recomputation in backward
            return
        key = (g.index, self.forwards)
        with self.relay.lock:
            if self._dead:  # a call less in the common case (Ir: docs/benchmarks)
                self._drain()
            if self._pending.get(key):
                self._held[key] = slab
                self.carrying.pop(key, None)  # carried again (called twice): now the last
                self.carrying[key] = None

    def carried(self, g: Group) -> torch.Tensor | None:
        """The slab this forward carries for ``g``, if any (``g`` is called again)."""
        key = (g.index, self.forwards)
        return self._held.get(key) if key in self.carrying else None

    def drop_carried(self, g: Group) -> None:
        """Carry nothing for ``g`` in this forward: its slab was written."""
        key = (g.index, self.forwards)
        with self.relay.lock:
            if key in self.carrying:
                del self.carrying[key]
                self._held.pop(key, None)

    def trim_carried(self, g: Group, room: int) -> None:
        """Carry at most ``room`` groups besides ``g`` (which runs now), dropping the first
        carried: a forward in another order than the last one's runs groups after those it
        carries, and what it holds must stay ``window`` groups. Called only where more than
        ``room`` are carried (the caller asks, a call less a group in the common case)."""
        now = (g.index, self.forwards)
        with self.relay.lock:
            others = [key for key in self.carrying if key != now]
            for key in others[: max(0, len(others) - room)]:
                del self.carrying[key]
                self._held.pop(key, None)

    # Note [hooks made once a forward]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Each group's forward pushes a pack and unpack pair that passes every tensor but the
    # group's weights to the hooks below it. The pair is made once for those hooks and kept
    # until the model's forward ends (a closure and two wrappers a group are a cost of their own,
    # docs/benchmarks/hooks-round2_cpu-2core_2026-12-05.md); a group run under other hooks (an
    # Offloader opened inside the forward) gets a pair of its own. It is not kept past the
    # forward (nor made for one outside it: a layer recomputed in backward), which would keep
    # the hooks below alive, and what they hold, after their scope.
    def hooks(self) -> tuple[Any, Any]:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = top if top is not None else (None, None)
        if not self.relay.depth:  # a recomputation in backward: not kept (see the Note)
            return self._make_hooks(outer_pack, outer_unpack)
        made = self._made
        if made is not None and made[0] is outer_pack and made[1] is outer_unpack:
            return made[2], made[3]
        ours = self._make_hooks(outer_pack, outer_unpack)
        self._made = (outer_pack, outer_unpack, *ours)
        return ours

    def forget_hooks(self) -> None:
        """The model's forward ended: drop the pair made for it (Note [hooks made once a forward])."""
        self._made = None

    # Note [passed on detached]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Where no hooks are below relay's, its pack keeps a tensor it passes on. A tensor with a
    # grad_fn (one that is no leaf) is kept detached: an op's output saved by that op
    # and kept as it is makes a cycle (output -> grad_fn -> saved -> output) that no collection
    # frees, as a tensor does not traverse its graph (pytorch/pytorch#115255). Every forward whose
    # graph is dropped without a backward, or kept with retain_graph, would leak what its layers
    # saved. Detached, it shares the storage and the version counter, and autograd gives the
    # unpacked tensor its grad_fn back. csrc/hot_path/passing.c does the same.
    def _make_hooks(self, outer_pack: Any, outer_unpack: Any) -> tuple[Any, Any]:
        slab_group = self.relay.slab_group
        plain, parameter = torch.Tensor, torch.nn.Parameter
        strided = torch.strided

        def pack(t: torch.Tensor) -> Any:
            kind = type(t)
            if (kind is plain or kind is parameter) and t.layout is strided:  # checked quickly
                try:
                    g = slab_group.get(t.untyped_storage()._cdata)
                except Exception:  # no storage of its own (a functional wrapper)
                    g = None
            else:
                s = storage_of(t)
                g = slab_group.get(s._cdata) if s is not None else None
            # a ref keeps the view's geometry, not its conjugate or negative bit
            if g is not None and not t.is_conj() and not t.is_neg():
                return self._ref(g, t)
            if outer_pack is not None:
                return outer_pack(t)
            # with its grad_fn, an op's output saved by that op is a cycle no collection frees
            # (Note [passed on detached])
            return t if t.is_leaf else t.detach()

        def unpack(x: Any) -> torch.Tensor:
            if type(x) is WeightRef:
                return self._unpack(x)
            return outer_unpack(x) if outer_unpack is not None else x

        ours: Any
        theirs: Any
        if PassPack is None:
            ours, theirs = unseen(pack), unseen(unpack, modes_aside=True)
        else:  # the same, with what they pass on passed in C (Note [hooks made once a forward])
            ours = PassPack(slab_group, unseen(pack), outer_pack, plain, parameter)
            theirs = PassUnpack(WeightRef, unseen(self._unpack, modes_aside=True), outer_unpack)
        setattr(ours, PASSES_TO, outer_pack)  # every other tensor goes where it would have
        return ours, theirs

    def _ref(self, g: Group, t: torch.Tensor) -> WeightRef:
        ref = WeightRef(self, g, t)
        key = ref.key
        with self.relay.lock:
            if self._dead:  # a call less in the common case (Ir: docs/benchmarks)
                self._drain()
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = set()
            if key not in self._bwd_at:
                self._bwd_at[key] = len(self._bwd_order)
                self._bwd_order.append(key)
            pending.add(id(ref))
        return ref

    def _drain(self) -> None:
        """Forget the refs autograd dropped unused (lock held)."""
        dead = self._dead
        while dead:
            i, ref_id = dead.popleft()
            pending = self._pending.get(i)
            if pending is None or ref_id not in pending:
                continue
            pending.discard(ref_id)
            if not pending:  # a key per group and forward: forgotten once its refs are
                del self._pending[i]
                self._held.pop(i, None)
                self.carrying.pop(i, None)
                self._bwd.pop(i, None)  # a read in flight keeps its slab until it lands

    def _unpack(self, ref: WeightRef) -> torch.Tensor:
        g = ref.group
        if ref.generation != g.generation:
            raise RelayError(
                f"the weights of {g.name!r} were replaced after forward saved them "
                "(load_state_dict or offloadd.resident between forward and backward): "
                "backward would use the new values"
            )
        key = ref.key
        if ref.unpacked:  # unpacked before: a retained graph's second backward
            return self._again_view(ref)
        slab = self._held.get(key)
        if slab is None:  # the key's first unpack: read it (or take its prefetch), read ahead
            t = self._bwd.pop(key, None)
            slab = self.relay.wait_for(t) if t is not None else self.relay.fetch(g)
            self.relay.store.swaps += 1
            self._prefetch_backward(key)
        elif key in self.carrying:  # carried from forward: its first unpack reads ahead
            self.carrying.pop(key, None)
            self.relay.store.swaps += 1
            self._prefetch_backward(key)
        ref.unpacked = True  # read: its key forgets it here (a failed read leaves it to _drain)
        with self.relay.lock:
            if self._dead:  # a call less in the common case (Ir: docs/benchmarks)
                self._drain()
            pending = self._pending.get(key)
            if pending is not None:
                pending.discard(id(ref))
            if pending:
                self._held[key] = slab
            else:
                self._pending.pop(key, None)
                self._held.pop(key, None)
                self.carrying.pop(key, None)
        return self.relay.slabs.view(slab, ref.geometry)

    def _again_view(self, ref: WeightRef) -> torch.Tensor:
        """A ref unpacked again (a second backward through a retained graph): each group is read
        once for all its refs, the ``window`` last ones kept until the next forward."""
        slab = self._again.get(ref.key)
        if slab is None:
            while len(self._again) >= self.relay.window:
                del self._again[next(iter(self._again))]
            slab = self._again[ref.key] = self.relay.fetch(ref.group)
        return self.relay.slabs.view(slab, ref.geometry)

    def _prefetch_backward(self, key: Key) -> None:
        order = self._bwd_order
        at = self._bwd_at.get(key)
        if at is None:
            return
        groups = self.relay.groups
        for j in reversed(order[max(0, at - self.relay.window + 1) : at]):
            if groups[j[0]].released:  # its refs raise at unpack (Note [made resident])
                continue
            if j not in self._held and j not in self._bwd and self._pending.get(j):
                self._bwd[j] = self.relay.read_ahead(groups[j[0]])
