"""offloadd under ``torch.compile``: hooks dynamo never traces, tensors it must not touch.

Note [invisible to dynamo]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A compiled region is one autograd node. Its saved tensors reach the pack hook when the region's
forward returns, at run time, with real tensors (AOTAutograd defers saved-tensor hooks until
then). But the region runs with dynamo's frame callback installed, so the hook's Python frame is
caught and traced like user code: dynamo then meets ``t.nbytes`` on a symbolic size, or builds
handles whose ``__init__`` it half ran. Every hook offloadd gives torch therefore runs with the
callback off (``unseen``), as ``torch.compiler.disable`` does, but through the C entry point, so
that a user who never compiles does not import dynamo (1.7 s here) and each call costs ~0.2 µs.

The global module pre-hook that notes parameters is the one hook dynamo must trace (it sits in
``Module._call_impl``, which dynamo inlines): were it hidden, every module call would be a graph
break. It returns at once while compiling (``torch.compiler.is_compiling()`` is a constant there),
so it adds nothing to the graph; the parameters of a compiled model are noted when its wrapper
(``OptimizedModule``), which runs eagerly, is called (see also [one module hook]).

A pack hook that still sees a fake, functional or meta tensor (tracing by some other path:
``make_fx``, ``torch.func``, an export) returns it untouched, and unpack returns it as it came.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from offloadd.auto.discover import find_blocks

__all__ = ["closed", "is_traced", "scope_opened", "scopes_closed", "split_regions", "unseen"]

_F = TypeVar("_F", bound=Callable[..., Any])

try:
    _set_eval_frame: Callable[[Any], Any] | None = torch._C._dynamo.eval_frame.set_eval_frame
except AttributeError:  # a build without dynamo: nothing can trace the hooks
    _set_eval_frame = None


def unseen(fn: _F) -> _F:
    """``fn``, run with dynamo's frame callback off (see [invisible to dynamo])."""
    set_eval_frame = _set_eval_frame
    if set_eval_frame is None:
        return fn

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        prior = set_eval_frame(None)
        try:
            return fn(*args)
        finally:
            set_eval_frame(prior)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def is_traced(t: torch.Tensor) -> bool:
    """Whether ``t`` has no bytes of its own to move: fake, functional or meta."""
    if t.is_meta:
        return True
    if type(t) is torch.Tensor:
        return torch._is_functional_tensor(t)
    return torch._is_functional_tensor(t) or isinstance(t, _traced_types())


@functools.cache
def _traced_types() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (FakeTensor, FunctionalTensor)


# -- regions ---------------------------------------------------------------------------------
#
# Note [regions under compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A compiled region is one autograd node: the saved tensors of all its ops reach pack together
# when its forward returns, and its backward unpacks them all before its first op. Compiled
# whole, a model therefore holds every saved byte at the end of forward and again at the start
# of backward, and offloadd can move nothing while the model computes. offloadd splits such a
# model into one region per block: the first time the wrapper ``torch.compile(model)`` returned
# is called in an Offloader's scope, each block (``find_blocks``, the planner's discovery) gets
# a forward hook that is a graph break to dynamo and nothing in eager. A block's activations
# then reach pack when that block returns and are written while the next block computes; its
# backward reloads only its own, while the prefetch brings the block before it. Graphs traced
# before the split are dropped (their code's cache is reset) and traced again, split.
#
# Why graph breaks, not offload ops placed in one graph by a pass: a break is the region
# torchtitan and most users compile anyway (per-block compile), it needs no private pass API,
# and the regions are plain AOTAutograd functions, so everything offloadd does in eager
# (dedup, capture, the prefetch window, the codecs) applies unchanged. What it costs: one
# Python return to eager per block boundary, measured in docs/benchmarks/compile_*.md.
#
# The split stays for the model's life (hooks are not guarded by dynamo: removing them at scope
# exit would leave whichever graph was traced last), so the model runs as per-block regions
# with or without offloading from then on. ``fullgraph=True`` (or ``error_on_graph_break``)
# forbids breaks: such a model is left whole, bit-exact, its saved tensors moved at the end of
# forward, and offloadd warns once.

_split: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def split_regions(module: nn.Module) -> bool | None:
    """For ``torch.compile(model)``'s wrapper, seen eagerly: split ``model`` at its blocks
    (see [regions under compile]). True if split now, False if it may not be (fullgraph),
    None if there is nothing to do (not a compiled wrapper, split already, no blocks)."""
    orig = getattr(module, "_orig_mod", None)
    if not isinstance(orig, nn.Module) or type(module).__name__ != "OptimizedModule":
        return None
    if orig in _split:
        return None
    ctx = getattr(module, "dynamo_ctx", None)
    if getattr(ctx, "fullgraph", False) or getattr(ctx, "error_on_graph_break", None):
        _split.add(orig)
        return False
    blocks = find_blocks(orig)
    _split.add(orig)
    if len(blocks) < 2:
        return None
    for _, block in blocks:
        block.register_forward_hook(_region_end)
    forward = getattr(type(orig).forward, "__code__", None)
    if forward is not None:
        torch._dynamo.reset_code(forward)
    return True


def _region_end(module: nn.Module, args: Any, output: Any) -> None:
    torch._dynamo.graph_break()


# -- the module hook ---------------------------------------------------------------------------
#
# Note [one module hook]
# ~~~~~~~~~~~~~~~~~~~~~~
# Modules called in an Offloader's scope are noted (their parameters are never moved) by one
# global forward pre-hook. Dynamo guards a compiled region on the keys of the global hook dict,
# so a hook registered at each scope's entry and removed at its exit has a new key each step:
# the region was traced again every step until dynamo's recompile limit, then ran in eager. The
# hook is therefore registered once, when the first Offloader enters a scope, and kept while
# any Offloader that entered one is open; it notes a module for each Offloader in a scope now.

_in_scope: weakref.WeakSet[Any] = weakref.WeakSet()
_entered: weakref.WeakSet[Any] = weakref.WeakSet()
_hook: list[Any] = []  # its handle, while registered


def _note(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return  # traced by dynamo: adds nothing to the graph (see [invisible to dynamo])
    for off in tuple(_in_scope):
        off._note_module(module)


def scope_opened(off: Any) -> None:
    """``off`` has a scope open now: modules called from now on are noted for it."""
    _entered.add(off)
    _in_scope.add(off)
    if not _hook:
        _hook.append(nn.modules.module.register_module_forward_pre_hook(_note))
        warnings.filterwarnings(  # the wrapper's own call is noted twice, harmlessly
            "ignore", message=r"Using `torch.compile\(module\)` when there are global hooks"
        )


def scopes_closed(off: Any) -> None:
    """``off`` has no scope open any more."""
    _in_scope.discard(off)


def closed(off: Any) -> None:
    """``off`` is closed: the hook goes when no open Offloader entered a scope."""
    _in_scope.discard(off)
    _entered.discard(off)
    if _hook and not _entered:
        _hook.pop().remove()
