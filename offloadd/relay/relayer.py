"""The relay of one model: :class:`Relay`, its forward and backward schedule.

Note [relay schedule]
~~~~~~~~~~~~~~~~~~~~~
Forward: the model's pre-hook starts reading the first groups of the last forward's order
(module order before the first forward). A group's pre-hook waits for its slab (or reads it
now), swaps its weights in (``param.data`` becomes a view of the slab, and the parameter takes
its placeholder's place in the module), and starts the read of the groups up to ``window - 1``
ahead, so that at most ``window`` groups are held. Its post-hook (run even if forward raised)
swaps the placeholders back and drops the slab; a weight whose version counter moved meanwhile
was changed in place, and raises.

Backward: while a group's forward runs, a saved-tensor hook (pushed above whatever hooks were
on top, an Offloader's included, which get every other tensor) turns each saved tensor that
lies in the group's slab into a :class:`~offloadd.relay.backward.WeightRef` (the view's offset, sizes, strides and
dtype), so autograd holds no weight bytes between forward and backward. The first unpack of a
group reads it back (or takes it from the prefetch), keeps the slab until its last ref is
unpacked or dropped, and starts reading the ``window - 1`` groups before it in pack order.
The last ``window`` groups of forward keep their slabs into backward instead (``Saved.carry``):
backward needs them first, and would otherwise begin with a read it waits for. A group called
again in the same forward swaps in the slab it carries. A forward in another order than the
last one's drops the reads it started for places it has passed, and carries no more than
leaves room for the group running and the reads ahead: what is held stays ``window`` groups
(and the reads in flight for the old order, until they land).

Exactness: the slab holds the bytes that were written, viewed with the strides and offsets the
weights had, at the same 64-byte alignment torch's allocator gives; a weight replaced after
forward (a load between forward and backward) bumps the group's generation, and its refs raise
as PyTorch's in-place check would.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from torch import nn

from offloadd.relay.backward import Saved
from offloadd.relay.groups import Group
from offloadd.relay.placeholder import RelayError
from offloadd.relay.release import release, unfreeze
from offloadd.relay.slabs import Slabs
from offloadd.relay.store import HostStore, Transfer, WeightStore
from offloadd.runtime.compiled import aside_modes
from offloadd.trace import span

__all__ = ["Relay"]

# what ``torch.autograd.graph.saved_tensors_hooks`` calls on entry and exit, without an object
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


class Relay:
    """Moves one model's frozen weights between the store and slabs as it runs."""

    def __init__(
        self,
        model: nn.Module,
        groups: list[Group],
        store: WeightStore | HostStore,
        window: int,
        slabs: Slabs,
    ) -> None:
        self.model = weakref.ref(model)  # the model holds the relay (its hooks), not back
        self.groups = groups
        self.store = store
        self.window = window
        self.slabs = slabs
        self.lock = threading.Lock()
        self.order: list[int] = [g.index for g in groups]
        self.order_at: dict[int, int] = {i: i for i in self.order}  # each group's place in it
        self._seen: list[int] = []
        self._fwd: dict[int, Transfer] = {}
        self._installed: dict[int, torch.Tensor] = {}  # group -> its slab while swapped in
        self.slab_group: dict[int, Group] = {}  # slab storage -> group, while swapped in
        self._keys: dict[int, int] = {}  # group -> its slab's storage, while swapped in
        self._pushed: dict[int, int] = {}  # group -> its forwards running with our hooks pushed
        self.saved = Saved(self)  # backward's side (backward.py)
        self.pinned: set[int] = set()  # swapped in by resident() or a load: forward leaves them
        # swapped in at a placeholder's use (Note [on demand]): group -> the backward's graph
        # task that read it in (-1: the model's forward), oldest first
        self._on_demand: dict[int, int] = {}
        self._ends: set[int] = set()  # the backwards whose end swaps their groups out
        self.depth = 0  # the model's forwards running (its pre- and post-hook)
        self._by_placeholder: dict[int, tuple[Group, Any]] = {}
        self._empties: dict[torch.dtype, torch.Tensor] = {}  # on self.device
        self.device = next((e.param.device for g in groups for e in g.entries), None)
        for g in groups:
            for e in g.entries:
                self.note_placeholder(g, e)

    @property
    def device(self) -> torch.device | None:
        """Where the relayed weights are used (None: the model relays none)."""
        return self._device

    @device.setter
    def device(self, device: torch.device | None) -> None:
        self._device = device
        # None on the host; asked once, as a device's ``.type`` builds a string each time
        self._accelerator = device if device is not None and device.type != "cpu" else None
        self._empties.clear()

    # -- reading --------------------------------------------------------------------------
    def read(self, g: Group) -> Transfer:
        return self.store.read(g.record, self.slabs, self._accelerator)  # type: ignore[arg-type]

    def wait_for(self, t: Transfer) -> torch.Tensor:
        if t.done is not None or t.error is not None:  # else: copied on the spot, done
            self.store.wait_s += t.wait()
        slab = t.slab
        assert slab is not None
        if t.copied is not None:  # copied on the host store's side stream (Note [host relay])
            assert isinstance(self.store, HostStore)
            self.store.await_copy(t)
        elif self._accelerator is not None and self._accelerator != slab.device:
            slab = slab.to(self._accelerator)  # a slab read from disk, to a model on a GPU
        return slab

    def read_ahead(self, g: Group) -> Transfer:
        """A read of ``g`` to wait for later: forward's, if forward started one and did not
        come to it (a forward in another order), else a new one."""
        return self._fwd.pop(g.index, None) or self.read(g)

    def fetch(self, g: Group) -> torch.Tensor:
        """``g``'s slab, read now (or taken from a read in flight)."""
        with span("offloadd::relay_fetch"):
            return self.wait_for(self.read_ahead(g))

    # -- forward ----------------------------------------------------------------------------
    def on_model_forward(self, module: nn.Module, args: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        self.store.begin_step()  # the daemon's client reconnects after a loss
        if torch._C._current_graph_task_id() == -1:
            self._ends.clear()  # no backward runs: those left are backwards that raised
        self._drop_on_demand()
        self.saved.new_forward()
        if self._seen:
            self.order = list(dict.fromkeys(self._seen))
            self.order_at = {i: at for at, i in enumerate(self.order)}
            self._seen = []
        first = self.order[: self.window]
        for i in [i for i in self._fwd if i not in first]:
            del self._fwd[i]  # read ahead for the last forward, which did not come to it
        for i in first:
            self._prefetch_forward(i)

    def after_model_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self.saved.forget_hooks()
            self._drop_on_demand()

    # Note [on demand]
    # ~~~~~~~~~~~~~~~~
    # A group's weights are swapped in by its pre-hook, which runs only when the group's module
    # is called. Code that reaches a weight another way while the model runs (a layer
    # recomputed in backward by calling its ``forward`` directly, as transformers' gradient
    # checkpointing does; a module whose parent reads its weight) meets the placeholder, which
    # asks :meth:`use`: during the model's forward or a backward, the group is read in now and
    # stays in (guarded, Note [write guard] in slabs.py), the ``window`` last groups read so at
    # most once the op that reads them has run (:meth:`trim`), until the model's forward ends,
    # or the backward that read it in ends (a callback queued on autograd's engine for that
    # graph task), whichever it was. Anywhere else the placeholder raises.
    #
    # Note [between steps]
    # ~~~~~~~~~~~~~~~~~~~~
    # Outside the model's forward and every backward, no group is swapped in but those that
    # ``resident()`` or a load pinned: each group is its placeholder, its bytes the store's
    # record. ``load_state_dict()``, ``resident()`` and ``.to()`` (model_ops.py) rely on it:
    # they swap in what they use themselves, unguarded where they write. So the model's forward
    # and backward both end by swapping out what they read in on demand (Note [on demand]); a
    # backward that raised runs no callback, so each of those operations first calls
    # :meth:`Relay.settle`, which swaps out what such a backward left in.
    def use(self, placeholder: Any) -> torch.Tensor | None:
        task = torch._C._current_graph_task_id()
        if self.depth == 0 and task == -1:
            return None
        found = self._by_placeholder.get(id(placeholder))
        if found is None:
            return None
        g, e = found
        if g.index not in self._installed:
            with aside_modes():  # called inside the op's modes (Note [below dispatch modes])
                self.install(g, self.fetch(g))
            self._on_demand[g.index] = task
            if task != -1 and task not in self._ends:
                self._ends.add(task)
                engine = torch.autograd.Variable._execution_engine
                engine.queue_callback(functools.partial(self._backward_ended, task))
        return e.param

    def trim(self) -> None:
        """Swap out the groups read in on demand beyond the last ``window`` (Note [on demand]):
        once the op that read them in has run, never while it is given them (an op taking
        weights of more groups than ``window``, such as a ``torch.cat`` of them, would get the
        first ones emptied)."""
        while len(self._on_demand) > self.window:
            self._swap_out(next(iter(self._on_demand)))

    def _backward_ended(self, task: int) -> None:
        self._ends.discard(task)
        self._drop_on_demand(task)

    def settle(self) -> None:
        """Swap out what was read in on demand and left in (Note [between steps]); only between
        steps: inside the model's forward or a backward, those groups are in use."""
        if self.depth == 0 and torch._C._current_graph_task_id() == -1:
            self._ends.clear()  # none runs: those left are backwards that raised
            self._drop_on_demand()

    def note_placeholder(self, g: Group, e: Any) -> None:
        self._by_placeholder[id(e.placeholder)] = (g, e)
        e.placeholder.relay_use = self.use
        e.placeholder.relay_trim = self.trim
        e.placeholder.relay_unfreeze = functools.partial(unfreeze, self)

    def forget_placeholder(self, e: Any) -> None:
        self._by_placeholder.pop(id(e.placeholder), None)
        e.placeholder.relay_use = None
        e.placeholder.relay_trim = None
        e.placeholder.relay_unfreeze = None

    def _drop_on_demand(self, task: int | None = None) -> None:
        """Swap out the groups read in on demand (by the backward ``task`` only, if given); if
        any was written meanwhile, raise once every one is out."""
        changed: list[str] = []
        for i in [i for i, t in self._on_demand.items() if task is None or t == task]:
            changed += self._swap_out(i, raises=False)
        if changed:
            raise RelayError(
                f"relayed weights were changed in place while the model ran: {', '.join(changed)}"
            )

    def _swap_out(self, i: int, raises: bool = True) -> list[str]:
        """Swap out group ``i``, read in on demand, unless pinned or its forward runs (its
        post-hook swaps it out); the names of its weights written meanwhile."""
        self._on_demand.pop(i, None)
        if i in self.pinned or self._pushed.get(i):
            return []
        changed = self.uninstall(self.groups[i])
        if changed and raises:
            raise RelayError(
                f"relayed weights were changed in place while the model ran: {', '.join(changed)}"
            )
        return changed

    def _prefetch_forward(self, i: int) -> None:
        if i not in self._fwd and i not in self._installed:
            self._fwd[i] = self.read(self.groups[i])

    def install(self, g: Group, slab: torch.Tensor, guard: bool = True) -> None:
        with span("offloadd::relay_swap"):
            # each weight's view, made once a slab (Note [slabs]); a device copy's, made now;
            # the slab guarded (Note [write guard] in slabs.py)
            views, key = self.slabs.swap_in(slab, g.layout, g.views_of, guard)
            for e, view in zip(g.entries, views, strict=True):
                p = e.param
                now = e.module._parameters.get(e.attr)
                if now is not e.placeholder and now is not p:
                    raise RelayError(
                        f"the weight {e.name!r} was replaced after offloadd.relay() (a new "
                        "parameter assigned to the module): unrelay the model first, or load "
                        "new values with load_state_dict()"
                    )
                if p.requires_grad:
                    raise RelayError(
                        f"the weight {e.name!r} was relayed as frozen and now requires grad "
                        "while the model runs: unfreeze relayed weights between steps (their "
                        "group is then made resident)"
                    )
                p.data = view
                e.version = p._version
                e.address = p.data_ptr()
                e.module._parameters[e.attr] = p
            self._installed[g.index] = slab
            self._keys[g.index] = key
            self.store.swaps += 1
            self.slab_group[key] = g

    def changes(self, g: Group, written: int | None = None) -> list[str]:
        """The names of ``g``'s weights changed while swapped in: in place (their version
        counter), through ``.data`` (a write the guard saw at byte ``written`` of the slab), or
        replaced by an assignment to ``.data`` (other memory, or the same bytes viewed another
        way: its first byte's address, shape, strides and dtype as installed; the same address
        is the same bytes of the slab)."""
        changed = []
        for e in g.entries:
            p = e.param
            if (
                p._version != e.version
                or p.data_ptr() != e.address
                or p.shape != e.size
                or p.stride() != e.stride  # w.data = w.data.t(), square: no byte moved
                or p.dtype != e.dtype
                or (written is not None and e.covers(written))
            ):
                changed.append(e.name)
        if written is not None and not changed:
            changed.append(f"{g.name} (byte {written} of its weights)")
        return changed

    def uninstall(self, g: Group) -> list[str]:
        """Swap the placeholders back; the names of weights changed meanwhile (:meth:`changes`)."""
        slab = self._installed.pop(g.index, None)
        if slab is None:
            return []
        key = self._keys.pop(g.index)
        self.slab_group.pop(key, None)
        changed = self.changes(g, self.slabs.swap_out(slab, key))
        for e in g.entries:
            e.module._parameters[e.attr] = e.placeholder
            empty = self._empties.get(e.dtype)
            e.param.data = empty if empty is not None else self._empty(e.dtype)
        return changed

    def _empty(self, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor on :attr:`device` for a weight swapped out to hold, one a dtype: no
        bytes to share, and one less allocation a swap."""
        empty = self._empties[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return empty

    def on_group_forward(self, g: Group, *hook_args: Any) -> None:
        """``g``'s forward pre-hook (``hook_args``: the module's, unused)."""
        if g.released:
            return
        in_backward = torch._C._current_graph_task_id() != -1  # a recomputation (checkpointing)
        if not in_backward and g.index not in self._installed:  # in backward, install raises
            for e in g.entries:
                if e.param.requires_grad:
                    release(self, g, f"{e.name!r} requires grad")  # Note [made resident]
                    return
        if not in_backward and self.depth:  # calls to layers without the model: never cleared
            self._seen.append(g.index)
        self._on_demand.pop(g.index, None)  # if read in on demand: its post-hook swaps it out
        # what forward carries is asked here before calling in: calls less a group (the
        # instruction counts in docs/benchmarks/relay-swap-round3_cpu-2core_2026-12-07.md)
        saved = self.saved
        if g.index not in self._installed:
            carried = None if in_backward or not saved.carrying else saved.carried(g)
            if carried is not None:  # called again in this forward (a layer used twice)
                self._fwd.pop(g.index, None)
            elif not in_backward:  # room for its read first: held, this group and the reads ahead
                room = self.window - 1 - len(self._fwd) + (g.index in self._fwd)
                if len(saved.carrying) > room:
                    saved.trim_carried(g, room)
            self.install(g, carried if carried is not None else self.fetch(g))
        if torch.is_grad_enabled():
            _push_hooks(*saved.hooks())
            self._pushed[g.index] = self._pushed.get(g.index, 0) + 1
        if in_backward:
            return
        at = self.order_at.get(g.index)
        if at is not None:
            ahead = self.order[at + 1 : at + self.window]
            for i in list(self._fwd):
                if i not in ahead:  # read for a place this forward has passed (another order)
                    del self._fwd[i]
            for i in ahead:
                self._prefetch_forward(i)
        # held now: this group, the reads ahead, and what forward carries for backward
        room = self.window - 1 - len(self._fwd)
        if len(saved.carrying) > room:
            saved.trim_carried(g, room)

    def after_group_forward(self, g: Group, *hook_args: Any) -> None:
        """``g``'s forward hook, run even if its forward raised (``hook_args``: unused)."""
        if g.released:
            return
        pushed = self._pushed.get(g.index, 0)
        if pushed:
            _pop_hooks()
            pushed -= 1
            self._pushed[g.index] = pushed
        if g.index in self.pinned or pushed:  # pinned, or an outer call of it still runs
            return
        slab = self._installed.get(g.index)
        changed = self.uninstall(g)
        if slab is not None and not changed:
            self.saved.carry(g, slab)
        if changed:
            self.saved.drop_carried(g)  # written (called again): backward reads the store's
            raise RelayError(
                f"relayed weights were changed in place during forward: {', '.join(changed)}. "
                "A relayed weight is frozen (a write through .data or a new .data counts too); "
                "change it with load_state_dict(), or within "
                "`with offloadd.resident(model):`, or unrelay the model"
            )

    def held_for_budget(self) -> int:
        """What a budget counts of relay (declared to ``HELD_ELSEWHERE`` in runtime/stages.py):
        the host slabs' peak on CPU; on a GPU the weights' device copies are the allocator's,
        measured."""
        on_host = self.device is None or self.device.type == "cpu"
        return self.slabs.peak_bytes if on_host else 0
