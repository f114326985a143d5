"""offloadd under ``torch.compile``: hooks dynamo never traces, tensors it must not touch.

Note [invisible to dynamo]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A compiled region is one autograd node. Its saved tensors reach the pack hook when the region's
forward returns, at run time, with real tensors (AOTAutograd defers saved-tensor hooks until
then). But the region runs with dynamo's frame callback installed, so the hook's Python frame is
caught and traced like user code: dynamo then meets ``t.nbytes`` on a symbolic size, or builds
handles whose ``__init__`` it half ran. Every hook offloadd gives torch therefore runs with the
callback off (``unseen``), as ``torch.compiler.disable`` does, but through the C entry point, so
that a user who never compiles does not pay for importing dynamo and each call costs next to
nothing (docs/benchmarks/hooks_cpu-2core_2026-12-05.md).

offloadd's common pack and unpack are C callables (``offloadd.runtime._held``): they have no
Python frame for dynamo to catch, and pass anything but a small tensor kept as it is to the
hidden Python hooks. No module hook is needed (see [no module hook]).

A pack hook that still sees a fake, functional or meta tensor (tracing by some other path:
``make_fx``, ``torch.func``, an export) returns it untouched, and unpack returns it as it came.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
from torch import nn

from offloadd.runtime.dedup import outermost_self

__all__ = [
    "aside_modes",
    "check_children",
    "check_wrapper",
    "is_traced",
    "is_wrapper",
    "refuse_budget",
    "refuse_codec",
    "scope_opened",
    "scopes_closed",
    "unseen",
    "wrapper_on_stack",
]

_F = TypeVar("_F", bound=Callable[..., Any])

try:
    _set_eval_frame: Callable[[Any], Any] | None = torch._C._dynamo.eval_frame.set_eval_frame
except AttributeError:  # a build without dynamo: nothing can trace the hooks
    _set_eval_frame = None


def unseen(fn: _F, compiled: Callable[[], None] | None = None, *, modes_aside: bool = False) -> _F:
    """``fn``, run with dynamo's frame callback off (see [invisible to dynamo]); ``compiled()``
    first when the callback was on (a hook of a module compiled whole, reached at a graph
    break). ``modes_aside``: and with the torch dispatch modes on the stack set aside while it
    runs (see [below dispatch modes])."""
    set_eval_frame = _set_eval_frame
    if set_eval_frame is None:
        if not modes_aside:
            return fn
        set_eval_frame = _no_frame_callback

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        prior = set_eval_frame(None)
        try:
            if compiled is not None and prior is not None:
                compiled()
            if modes_aside and _dispatch_modes():
                with _modes_set_aside():
                    return fn(*args)
            return fn(*args)
        finally:
            set_eval_frame(prior)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def _no_frame_callback(callback: Any) -> None:
    return None


_dispatch_modes = torch._C._len_torch_dispatch_stack


# Note [below dispatch modes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A module hook runs inside whatever dispatch modes the user's code entered around the module:
# a selective checkpoint's (which records every op of its region in forward and, from torch
# 2.13, replays that list op for op in the recompute, raising at an op it did not record), a
# FLOP counter, a debug mode. Relay's hooks do tensor work of their own there: a slab's views
# made the first time it holds a layout, a handle on a slab, a read. That work is not the
# model's and differs between a forward and its recompute (a slab that holds the layout
# already makes no views), so relay runs it with the modes set aside.
def aside_modes() -> AbstractContextManager[Any]:
    """The torch dispatch modes on the stack set aside while inside (see [below dispatch
    modes]); a no-op context where there are none."""
    return _modes_set_aside() if _dispatch_modes() else contextlib.nullcontext()


def _modes_set_aside() -> AbstractContextManager[Any]:
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _skip_the_wrappers_frames() -> None:
    """Have dynamo's frame callback run ``unseen``'s wrapper as it is. A module hook of a layer
    compiled on its own (``layer.compile()``) is called at a graph break with the callback on,
    which caught the wrapper's frame before its first line turned the callback off, traced it,
    and warned that it cannot trace ``set_eval_frame``. Every wrapper shares one code object,
    marked once here, as ``torch._dynamo.eval_frame.skip_code`` marks one (without importing
    dynamo)."""
    if _set_eval_frame is None:  # a build without dynamo: nothing to skip
        return
    frames = torch._C._dynamo.eval_frame
    mark = getattr(frames, "set_code_exec_strategy", None)
    if mark is None:  # another torch's API: the wrapper's frame is traced, and breaks
        return
    skip = frames._FrameAction.SKIP
    strategy = frames._FrameExecStrategy(skip, frames._FrameAction.DEFAULT)
    mark(unseen(lambda: None).__code__, strategy)


_skip_the_wrappers_frames()


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
# A whole-model compile is not split at its blocks (a graph break after each block): inductor
# fuses across the block boundaries of the whole graph, so the split model's gradients differ in
# the last bits from the model compiled whole, which is what the user gets without offloadd
# (docs/benchmarks/compile-evict_cpu-2core_2026-11-25.md).

# -- no module hook ----------------------------------------------------------------------------
#
# Note [no module hook]
# ~~~~~~~~~~~~~~~~~~~~~
# An Offloader needs three things from the modules called in its scope, and takes each without
# a global module hook (one adds a cost to every module call, docs/benchmarks/
# hooks_cpu-2core_2026-12-05.md, and makes ``torch.compile(model)`` warn for every user that
# global hooks fire an extra time):
#
# - the storages of parameters and buffers, which are never moved: a parameter or a view of one
#   is told by its type alone; a buffer or another plain alias of a module's storage is looked up
#   by the StorageIndex, which learns the storages of the modules on the Python stack when a
#   tensor that might be one is about to move (see [parameters learned] in dedup.py);
# - with ``compile_ops``, inductor's pass (Note [emptied in the graph] in graph_ops.py) before a
#   model compiled whole is first compiled in a scope: dynamo's compile-start callback
#   (registered at a scope's entry once dynamo is imported, and again after
#   ``torch._dynamo.reset()`` cleared it) adds it when an Offloader
#   that wants it has a scope open and ``OptimizedModule.__call__`` is on the stack;
# - with a budget, the model to plan: the planner's first module. Only then, and only until it
#   has one, one global pre-hook notes the first module called in the scope (``note_wrapper``
#   refuses a model compiled whole there). It is removed in that same call, before any compiled
#   region of the model runs, so a guard dynamo keeps on the global hooks sees none.

_lock = threading.Lock()
_in_scope: weakref.WeakSet[Any] = weakref.WeakSet()  # Offloaders with a scope open
_awaiting: weakref.WeakSet[Any] = weakref.WeakSet()  # ... whose planner has no model yet
_hook: list[Any] = []  # the pre-hook's handle while one awaits


def _note(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return  # traced by dynamo: adds nothing to the graph (see [invisible to dynamo])
    with _lock:
        offs = tuple(_awaiting)
    for off in offs:
        off.note_module(module)
    with _lock:
        for off in offs:
            if not off.awaits_model():
                _awaiting.discard(off)
        _unhook()


def _unhook() -> None:
    """Remove the pre-hook once no Offloader awaits its model (lock held)."""
    if _hook and not _awaiting:
        _hook.pop().remove()


def scope_opened(off: Any) -> None:
    """``off`` has a scope open now."""
    with _lock:
        _in_scope.add(off)
        if off.awaits_model():
            _awaiting.add(off)
            if not _hook:
                _hook.append(nn.modules.module.register_module_forward_pre_hook(_note))
        if "torch._dynamo" in sys.modules:
            # again after ``torch._dynamo.reset()``, which clears the callbacks
            from torch._dynamo.callback import callback_handler

            if _compile_starts not in callback_handler.start_callbacks:
                callback_handler.register_start_callback(_compile_starts)


def scopes_closed(off: Any) -> None:
    """``off`` has no scope open any more (or is closed)."""
    with _lock:
        _in_scope.discard(off)
        _awaiting.discard(off)
        _unhook()


def _compile_starts(args: Any) -> None:
    """Dynamo begins to compile a frame: add the pass first if a model compiled whole is
    called in the scope of an Offloader that wants it (see [no module hook])."""
    with _lock:
        wants = any(off.wants_pass() for off in _in_scope)
    if wants and wrapper_on_stack() is not None:
        _install_pass()


def wrapper_on_stack() -> nn.Module | None:
    """The outermost ``torch.compile(model)`` wrapper being called on this thread, if any."""
    from torch._dynamo.eval_frame import OptimizedModule

    wrapper: nn.Module | None = outermost_self(OptimizedModule.__call__.__code__)
    return wrapper


def refuse_codec(name: str) -> RuntimeError:
    return RuntimeError(
        f"offloadd: codec.name={name!r} does not run under torch.compile: a "
        "compiled region's saved tensors reach offloadd without the op that saved them, which "
        "the codec needs to choose what it may code; set codec.name='none' "
        "(OFFLOADD_CODEC_NAME=none) or run this model eagerly"
    )


def refuse_budget(budget: Any) -> RuntimeError:
    return RuntimeError(
        f"offloadd: budget={budget!r} does not plan a model compiled whole "
        "(torch.compile(model)): the compiled model is one region whose saved tensors reach "
        "offloadd together when its forward returns, so no block can be kept, offloaded or "
        "recomputed apart; compile each block instead (`block.compile()`, which the budget "
        "plans around), or set budget='off' (OFFLOADD_BUDGET=off)"
    )


def is_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(model)``'s wrapper (``OptimizedModule``)."""
    orig = getattr(module, "_orig_mod", None)
    return type(module).__name__ == "OptimizedModule" and isinstance(orig, nn.Module)


def check_wrapper(off: Any, module: nn.Module) -> nn.Module:
    """The module to note for ``module`` noted by ``off``: the model itself for a
    ``torch.compile(model)`` wrapper (whose pass is added now, before its first call compiles
    it; refused in a scope with a codec or a budget), else ``module``."""
    if not is_wrapper(module):
        return module
    orig: nn.Module = module._orig_mod  # type: ignore[assignment]  # is_wrapper checked it
    if _in_scope_now(off):
        _refuse(off, orig, True)
        if off.wants_pass():
            _install_pass()
    return orig


def check_children(off: Any, model: nn.Module) -> None:
    """In a scope, a codec refuses a wrapper among ``model``'s submodules, and a budget one
    whose model holds what it plans (called once the planner has its model)."""
    if _in_scope_now(off):
        for m in model.modules():
            if m is not model and is_wrapper(m):
                _refuse(off, m._orig_mod, False)  # type: ignore[arg-type]


def _in_scope_now(off: Any) -> bool:
    return off.in_scope() and torch.is_grad_enabled()


def _refuse(off: Any, orig: nn.Module, outermost: bool) -> None:
    cfg = off.config
    if cfg.codec.name != "none":
        raise refuse_codec(cfg.codec.name)
    planner = off.planner
    if cfg.budget is not None and (outermost or planner is None or planner.plans_within(orig)):
        # what the budget plans is inside the region; a block compiled by a wrapper of its own
        # (``torch.compile(block)``) is planned around, as ``block.compile()`` is
        raise refuse_budget(cfg.budget)


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
    """warnings' stacklevel of the first frame outside offloadd, torch and the standard library
    (the user's call; dynamo's compile-start callback runs under ``contextlib``)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stdlib = os.path.dirname(os.__file__)
    ours = (here + os.sep, os.path.dirname(torch.__file__) + os.sep)
    stdlib += os.sep
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and _skipped(frame.f_code.co_filename, ours, stdlib):
        frame, level = frame.f_back, level + 1
    return level


def _skipped(path: str, ours: tuple[str, ...], stdlib: str) -> bool:
    """offloadd's and torch's files, and the standard library's (not its site-packages)."""
    if path.startswith(ours):
        return True
    return path.startswith(stdlib) and "-packages" + os.sep not in path[len(stdlib) :]
