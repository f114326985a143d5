"""A model compiled whole streams: its saved tensors are emptied inside its graph, read back
inside its backward's.

Note [emptied in the graph]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A compiled region is one autograd node (see [regions under compile] in compiled.py): left to
the saved-tensor hooks alone, all its saved tensors reach pack when its forward returns, and
unpack before its backward's first op. So an inductor post-grad pass (:class:`Placement`, added
when a compiled model is first called in an Offloader's scope) adds two ops to each training
graph it compiles, and changes nothing else:

* forward: ``offloadd::evict(t, after, True)`` for each activation ``t`` the graph returns to
  be saved (made by the graph, not a view, no view made of it), where ``after`` is a buffer
  the graph returns that is computed after every kernel that may read ``t`` (Note [who reads
  t]). It packs ``t`` with the Offloader whose hooks are innermost (none: it does nothing) and
  captures it; once the block no longer holds ``t``'s pages (at once after a copy to staging;
  after the last write of a zero-copy write, checked at each later evict), ``t``'s storage is
  resized to nothing, its memory free while the rest of the graph runs. When the region's
  forward returns, autograd calls pack with ``t`` (emptied or not); pack claims what evict
  packed and returns an :class:`~offloadd.runtime.evicted.Evicted`, whose unpack is a
  placeholder without bytes;
* backward: ``offloadd::fetch(t, after)`` before the first op that reads a saved tensor ``t``
  that its own forward gave an evict (how its pass knows which: Note [whose backward] in
  graph_records.py), after the last gradient the graph returns before that op (a dependency:
  else inductor may run every fetch at the backward's start): the tensor read back through
  ``Hooks.unpack`` (which prefetches the ones before it), copied into a buffer of ``t``'s
  strides (inductor asserts them, and may reuse the memory of what an op returns). A ``t``
  with its bytes (not offloaded, or no Offloader) is copied as it is.

Why it is bit-identical: the partition between forward and backward, the buffers the graph
returns and their layouts are those inductor makes without offloadd. ``evict`` only reads two
buffers the graph returns anyway (``flexible_layout``: it constrains no layout) and is ordered
by that data dependency, not by a declared mutation (declaring one split fused kernels around
it); ``fetch`` stands in for a graph input with a buffer of the same layout. The first design,
saved-tensor hooks inlined by AOTAutograd, changed what the graph returns, and inductor fused
one loop differently (one ulp on ``(h.t().contiguous().t() * h[:, ::2].sin().repeat(1,
2)).cos().sum()``, now a test). Not by construction, though: the scheduler may still group
kernels differently around an ``evict`` (one fused kernel has become two on a ``bmm`` model,
with identical results). Every model tried is bit-identical (tests/runtime/test_compile.py
and the sweep in docs/benchmarks/compile-evict_cpu-2core_2026-11-25.md); ``compile_ops=false``
is the switch for a model that is not.

Limits: only CPU tensors are emptied (a CUDA copy out is asynchronous, and freeing its source
needs stream ordering that no run on a GPU has tried yet; such regions hold their saved tensors
to the end of forward, as without this); not with CUDA graphs, whose memory is theirs. A graph
compiled before its model was called in a scope has no ops (exact; streams as a region), and
one compiled with them and run without offloadd copies each saved tensor in backward. The pass
is process-wide once added (inductor's config is): graphs compiled later, for any model, carry
the ops, and an Offloader with ``compile_ops=false`` (or tier keep) makes its evicts do nothing.
On a torch that runs one post-grad pass (< 2.12), offloadd's runs after the one set before it,
whose key (or its absence: no caching) carries over.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any

import torch
import torch.fx
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

try:
    from torch._inductor.custom_graph_pass import get_custom_graph_passes
except ImportError:  # torch < 2.12: inductor runs one post-grad pass
    get_custom_graph_passes = None  # type: ignore[assignment]

from offloadd.runtime import evicted, graph_records
from offloadd.runtime.handles import Ref

__all__ = ["Placement", "install"]

# -- the ops ---------------------------------------------------------------------------------


@torch.library.custom_op("offloadd::evict", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def evict(t: Tensor, after: Tensor, empty: bool) -> None:
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    off = getattr(top[0], "offloader", None) if top is not None else None
    if off is None or t.device.type != "cpu" or type(t) is not torch.Tensor:
        return
    if not off.config.compile_ops or off.config.tier == "keep":
        return  # the pass is process-wide: this Offloader asked for no ops (or moves nothing)
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if not nbytes or storage._cdata in evicted.claims():
        return  # emptied, or packed already (an alias another evict saw)
    ran[0] += 1
    packed = off.hooks.pack(t)
    off.life.capture_all()  # t's producer has returned (and, to empty it, its readers)
    block = packed.block if type(packed) is Ref and packed.tensor is None else None
    if empty and block is not None and block.copy_done is None and block.nbytes == nbytes:
        evicted.note(off, t, packed, storage, block)  # emptied once its bytes are out
    else:
        evicted.note(off, t, packed, storage, None)


@evict.register_fake
def _evict_fake(t: Tensor, after: Tensor, empty: bool) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.offloadd.evict.default)


@torch.library.custom_op("offloadd::fetch", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fetch(t: Tensor, after: Tensor) -> Tensor:
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    storage = t.untyped_storage()
    if storage.nbytes() or t.numel() == 0:
        return out.copy_(t)
    ev = evicted.take_placed(storage._cdata)
    if ev is None:
        raise RuntimeError(
            "offloadd: a compiled backward got a saved tensor without its bytes and without "
            "offloadd's record of them (see [emptied in the graph] in runtime/graph_ops.py)"
        )
    return out.copy_(ev.off.hooks.unpack(ev.ref))


@fetch.register_fake
def _fetch_fake(t: Tensor, after: Tensor) -> Tensor:
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)


# -- the pass ----------------------------------------------------------------------------------


def _is_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` shares its input's storage: a view op, or an element of the list a
    view op returns (``split``, ``unbind``, ``chunk``)."""
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )  # not an in-place op (``copy_``): it returns what it wrote, not a view of ``t``


def _is_tensor(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)


def _on_cpu(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


class Placement(CustomGraphPass):
    """Inductor's post-grad pass: ``evict`` and ``fetch`` in a training graph's forward and
    backward (Note [emptied in the graph])."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor import config

        if config.triton.cudagraphs:
            return
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        if any(n.name.startswith("tangents_") for n in inputs):
            _place_fetches(graph, inputs)
        elif any(n.name.startswith("primals_") for n in inputs):
            _place_evicts(graph)

    def uuid(self) -> Any:
        # A cached graph is placed by this code; a backward's fetches also depend on what its
        # forward's pass gave an evict (forward-only facts: user outputs, views), so that
        # record is part of its key (without it, a cached backward lacked a fetch). A
        # forward is keyed before its pass runs: no record yet.
        files = (__file__, graph_records.__file__)
        return (get_hash_for_files(files), graph_records.recorded())


ran = [0]  # evicts that packed a tensor (for tests: a cached graph places nothing)
unmatched = [0]  # backward graphs placed without their forward's record (for tests)


def _place_fetches(graph: torch.fx.Graph, inputs: list[torch.fx.Node]) -> None:
    # The saved tensors come first, in the order the forward returns them (Note [whose
    # backward]): its record says which were emptied; without one, all that it made.
    saved = [
        p
        for p in itertools.takewhile(lambda p: not p.name.startswith("tangents_"), inputs)
        if isinstance(p.meta.get("val"), Tensor)
    ]
    positions = graph_records.emptied(saved)
    if positions is not None:
        fetched = [p for i, p in enumerate(saved) if i in positions]
    else:
        unmatched[0] += 1
        fetched = [p for p in saved if not p.name.startswith("primals_")]
    order = {n: i for i, n in enumerate(graph.nodes)}
    fetch_op = torch.ops.offloadd.fetch.default
    # Ordered after the last gradient the graph returns before the tensor's first use: without
    # a dependency inductor may run every fetch at once, at the backward's start.
    outs = graph.output_node().args[0]
    grads = sorted(
        (n for n in outs if isinstance(n, torch.fx.Node) and _is_tensor(n)),  # type: ignore[union-attr]
        key=order.__getitem__,
    )
    for p in fetched:
        if not p.users or not _on_cpu(p):
            continue
        first = min(p.users, key=order.__getitem__)
        done = [g for g in grads if order[g] < order[first]]
        with graph.inserting_before(first):
            f = graph.call_function(fetch_op, (p, done[-1] if done else p))
        f.meta["val"] = p.meta["val"]
        p.replace_all_uses_with(f, delete_user_cb=functools.partial(operator.is_not, f))


def _place_evicts(graph: torch.fx.Graph) -> None:
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is None:
        return
    outs: list[Any] = list(graph.output_node().args[0])  # type: ignore[arg-type]
    saved = outs[meta.tensors_saved_for_backwards_slice]
    returned = {n for n in outs if isinstance(n, torch.fx.Node) and _is_tensor(n)}
    emptied: list[int] = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    user_outs = set(outs[: meta.tensors_saved_for_backwards_slice.start])
    evict_op = torch.ops.offloadd.evict.default
    for i, t in enumerate(saved):
        if (
            not isinstance(t, torch.fx.Node)
            or t.op != "call_function"
            or t in user_outs
            or _is_view(t)
            or not _on_cpu(t)
            or not _views(t).isdisjoint(outs)
        ):
            continue  # an input, a user's output, a view, or one with a view the graph returns
        after = _after_readers(t, returned, order)
        if after is None:
            # Read to the graph's end: packed as soon as made (written while the forward
            # runs, read back when its backward needs it), never emptied.
            with graph.inserting_after(t):
                graph.call_function(evict_op, (t, t, False))
        else:
            with graph.inserting_after(after):
                graph.call_function(evict_op, (t, after, True))
        emptied.append(i)
    graph_records.record(emptied, saved)  # for its backward's pass (Note [whose backward])


def _after_readers(
    t: torch.fx.Node, returned: set[torch.fx.Node], order: dict[torch.fx.Node, int]
) -> torch.fx.Node | None:
    """The first buffer the graph returns that is computed after every kernel that may read
    ``t``, or None (see [who reads t] below)."""
    todo = _readers(t)
    if not todo:
        return t
    frontier: set[torch.fx.Node] = set()
    seen: set[torch.fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        users = _readers(n)
        if _is_view(n):
            todo.extend(users)  # t's own storage: what reads it reads t
        elif n in returned or (users and all(map(_realizes_inputs, users))):
            frontier.add(n)  # a buffer: what reads it does not read t
        elif not users:
            return None  # a side effect (an input's copy_): no buffer is computed after it
        else:
            todo.extend(users)
    common: set[torch.fx.Node] | None = None
    for f in frontier:
        below = _below(f) & returned
        common = below if common is None else common & below
    return min(common, key=order.__getitem__) if common else None


def _realizes_inputs(node: torch.fx.Node) -> bool:
    """Whether inductor certainly reads ``node``'s inputs from buffers: an op it has no
    lowering for or falls back on (a ``FallbackKernel`` realizes every input). Not
    ``lowering.needs_realized_inputs``: some of its ops (pooling, upsampling) only hint, and a
    one-read pointwise input is then inlined (a reproducer, now a test, read emptied bytes that
    way); not the matmuls either: a ``bmm`` with a dimension of 1 is lowered as a
    multiply and a sum, which inline their input."""
    from torch._inductor import lowering

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target not in lowering.lowerings or target in lowering.fallbacks


def _views(t: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes that view ``t``'s storage, through views of views."""
    return _reach(t, _is_view) - {t}


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that use ``node``, but the output and the evicts placed already (an evict
    takes its ``after`` for its order only, and never reads its bytes)."""
    evict_op = torch.ops.offloadd.evict.default
    return [u for u in node.users if u.op != "output" and u.target is not evict_op]


def _below(node: torch.fx.Node) -> set[torch.fx.Node]:
    return _reach(node, lambda u: True)


def _reach(node: torch.fx.Node, follow: Any) -> set[torch.fx.Node]:
    """``node`` and the nodes reached from it through users that ``follow`` accepts."""
    seen = {node}
    todo = [node]
    while todo:
        for u in todo.pop().users:
            if u not in seen and follow(u):
                seen.add(u)
                todo.append(u)
    return seen


# Note [who reads t]
# ~~~~~~~~~~~~~~~~~~
# A node of the FX graph is not a kernel: inductor inlines a pointwise node into each consumer
# unless it realizes it into a buffer, so a kernel several nodes below ``t`` may still read
# ``t``'s bytes. (Placing ``evict`` after ``t``'s direct readers emptied bytes that a later
# fused kernel read: a crash.) Which nodes inductor realizes depends on heuristics, except:
# * a node the graph returns is realized as soon as it is lowered (``GraphLowering.run_node``;
#   one without reads, a constant, may wait, but reads nothing);
# * a node whose every user is a fallback kernel is read from a buffer by all of them (not so
#   for ops that only hint: pooling inlined a ``t * 2`` after evict, a crash);
# * a view is ``t``'s own storage: the walk goes through it (and ``t`` is never emptied if the
#   graph returns a view of it).
# So the nodes whose kernels may read ``t`` are those reached from its readers without passing
# such a buffer, and every one of them is above some buffer of that walk's frontier; ``after``
# is the first returned node below every frontier node, a data dependency inductor keeps
# through fusion and reordering. A walk that meets a node nothing uses and the graph does not
# return (an input's ``copy_``) has no such ``after``: ``t`` is then packed, not emptied.


_PASS = Placement()


class _Both(CustomGraphPass):
    """A pass set before offloadd's (a CustomGraphPass or a plain function), then Placement:
    for a torch that runs one pass only."""

    def __init__(self, first: Any) -> None:
        self.first = first

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.first(graph)
        _PASS(graph)

    def uuid(self) -> Any:
        # No key (None: inductor does not cache) unless the first pass has one: a pass that
        # declines caching keeps declining it (a key made of its None served a stale graph once
        # it changed what it does).
        first = self.first.uuid() if isinstance(self.first, CustomGraphPass) else None
        return (first, _PASS.uuid()) if first else None


def install() -> None:
    """Add :class:`Placement` to inductor's post-grad passes (once; others' stay)."""
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    if get_custom_graph_passes is not None:
        passes = get_custom_graph_passes(current)
        if not any(isinstance(p, Placement) for p in passes):
            config.post_grad_custom_post_pass = [*passes, _PASS] if passes else _PASS
    elif current is None:
        config.post_grad_custom_post_pass = _PASS
    elif not isinstance(current, Placement | _Both):
        config.post_grad_custom_post_pass = _Both(current)
