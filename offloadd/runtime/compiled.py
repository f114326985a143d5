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
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "is_traced",
    "note_wrapper",
    "scope_opened",
    "scopes_closed",
    "unseen",
]

_F = TypeVar("_F", bound=Callable[..., Any])

try:
    _set_eval_frame: Callable[[Any], Any] | None = torch._C._dynamo.eval_frame.set_eval_frame
except AttributeError:  # a build without dynamo: nothing can trace the hooks
    _set_eval_frame = None


def unseen(fn: _F, compiled: Callable[[], None] | None = None) -> _F:
    """``fn``, run with dynamo's frame callback off (see [invisible to dynamo]); ``compiled()``
    first when the callback was on (a hook of a module compiled whole, reached at a graph
    break)."""
    set_eval_frame = _set_eval_frame
    if set_eval_frame is None:
        return fn

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        prior = set_eval_frame(None)
        try:
            if compiled is not None and prior is not None:
                compiled()
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
# A compiled region is one autograd node: left to saved-tensor hooks, the saved tensors of all
# its ops reach pack together when its forward returns, and its backward unpacks them all before
# its first op. A model compiled per block (``block.compile()`` for each, as torchtitan does)
# therefore streams block by block with offloadd's ordinary hooks. A model compiled whole would
# hold every saved byte at the end of forward; with ``Config.compile_ops`` (the default) an
# inductor pass empties each saved activation inside the graph once read and its backward reads
# it back (Note [emptied in the graph] in graph_ops.py), bit-exact.
#
# Splitting a whole-model compile at its blocks (a graph break after each block) was tried
# first and removed: inductor fuses across the block boundaries of the whole graph, so the split
# model's gradients differed in the last bits from the model compiled whole (head.bias by
# 9.3e-9 on a 6-block MLP), which is what the user gets without offloadd.

# -- the module hook ---------------------------------------------------------------------------
#
# Note [one module hook]
# ~~~~~~~~~~~~~~~~~~~~~~
# Modules called in an Offloader's scope are noted (their parameters are never moved) by one
# global forward pre-hook. Dynamo guards a compiled region on the keys of the global hook dict,
# so a hook registered at each scope's entry and removed at its exit has a new key each step:
# the region was traced again every step until dynamo's recompile limit, then ran in eager. The
# same happened with a hook removed when the last Offloader closed: a new Offloader per epoch
# recompiled every model each epoch, eager after the eighth. So the hook is registered when the
# first Offloader enters a scope and stays for the life of the process; it notes a module for
# each Offloader in a scope now and returns at once otherwise (about 2 us a module call, the
# cost of any global hook). torch warns once that ``torch.compile(model)``'s wrapper sees global
# hooks fire for it too: harmless here (the wrapper is noted as its model).

_lock = threading.Lock()
_in_scope: weakref.WeakSet[Any] = weakref.WeakSet()
_hook: list[Any] = []  # its handle, once registered


def _note(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return  # traced by dynamo: adds nothing to the graph (see [invisible to dynamo])
    with _lock:
        offs = tuple(_in_scope)
    for off in offs:
        off._note_module(module)


def scope_opened(off: Any) -> None:
    """``off`` has a scope open now: modules called from now on are noted for it."""
    with _lock:
        _in_scope.add(off)
        if not _hook:
            _hook.append(nn.modules.module.register_module_forward_pre_hook(_note))


def scopes_closed(off: Any) -> None:
    """``off`` has no scope open any more (or is closed)."""
    with _lock:
        _in_scope.discard(off)


def note_wrapper(off: Any, module: nn.Module) -> bool:
    """If ``module`` is ``torch.compile(model)``'s wrapper, called eagerly: note all of the
    model's modules for ``off`` (inside the compiled region no hook notes them) and, in a scope,
    refuse a codec and add the pass that makes the graph stream (Note [emptied in the graph] in
    graph_ops.py) before this first call compiles it. False for any other module."""
    orig = getattr(module, "_orig_mod", None)
    if type(module).__name__ != "OptimizedModule" or not isinstance(orig, nn.Module):
        return False
    in_scope = bool(getattr(off._tls, "stack", None)) and torch.is_grad_enabled()
    cfg = off.config
    if in_scope and cfg.codec.name != "none":
        raise RuntimeError(
            f"offloadd: codec.name={cfg.codec.name!r} does not run under torch.compile: a "
            "compiled region's saved tensors reach offloadd without the op that saved them, which "
            "the codec needs to choose what it may code; set codec.name='none' "
            "(OFFLOADD_CODEC_NAME=none) or run this model eagerly"
        )
    planner = getattr(off, "_auto", None)
    if in_scope and cfg.budget is not None and (planner is None or planner.plans_within(orig)):
        # what the budget plans is inside the region; a block compiled by a wrapper of its own
        # (``torch.compile(block)``) is planned around, as ``block.compile()`` is
        raise RuntimeError(
            f"offloadd: budget={cfg.budget!r} does not plan a model compiled whole "
            "(torch.compile(model)): the compiled model is one region whose saved tensors reach "
            "offloadd together when its forward returns, so no block can be kept, offloaded or "
            "recomputed apart; compile each block instead (`block.compile()`, which the budget "
            "plans around), or set budget='off' (OFFLOADD_BUDGET=off)"
        )
    for m in orig.modules():
        off.note_module(m)
    if in_scope and cfg.compile_ops and cfg.tier != "keep":
        _install_pass()
    return True


_refused: list[str] = []  # why the pass cannot be added (warned once, not retried)


def _install_pass() -> None:
    if _refused:
        return
    try:
        from offloadd.runtime import graph_ops

        graph_ops.install()
    except Exception as e:  # a torch without what it needs (custom ops, tags, pass keys)
        _refused.append(f"torch {torch.__version__} lacks what it needs ({e!r})")
        warnings.warn(
            f"offloadd: compile_ops is on but compiled graphs do not empty their saved tensors: "
            f"{_refused[0]}. They stay exact; a region's saved tensors move when its forward "
            "returns (set compile_ops=false to silence this)",
            stacklevel=_user_level(),
        )


def _user_level() -> int:
    """warnings' stacklevel of the first frame outside offloadd and torch (the user's call)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skip = (here + os.sep, os.path.dirname(torch.__file__) + os.sep)
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level
