"""How a planned block is recomputed: its class swapped for a subclass whose ``forward`` asks the
planner, and non-reentrant checkpointing with every argument passed positionally.

Note: [recompute wrapper] The block's class, not the instance, gets the wrapper: a subclass made
once per class, whose ``forward`` looks the planner up through a weak reference kept on the
module. An instance attribute would survive ``copy.deepcopy`` (an EMA copy) and
``DataParallel`` replicas pointing at the original module's bound ``forward``, so a copy would
silently run with the original's weights; the subclass runs on whatever instance it is called
on. Keyword tensors are passed to ``torch.utils.checkpoint`` positionally, because it saves the
accelerator RNG state only for devices of positional tensors: a block called as ``block(x=h)``
on CUDA would otherwise recompute dropout with another mask. A transformers key/value cache is
dropped for the recomputation, as transformers' own checkpointing does (it is updated in place,
so the recomputation would append to it again), but only when the forward began with an empty
cache: a cache holding a prefix (past tokens, prefix tuning) changes what the block computes,
and such forwards are not recomputed.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offloadd.runtime.compiled import unseen
from offloadd.runtime.hook_stack import saves_reach_offloadd

__all__ = [
    "cache_holds_prefix",
    "checkpointed",
    "install",
    "remove",
    "run_checkpointed",
    "warn_checkpointed",
]

log = logging.getLogger("offloadd")

_SUBCLASSES: dict[type, type] = {}
_ATTR = "_offloadd_planned"  # (weakref to the planner, block index), in the module's __dict__


def _is_cache(v: Any) -> bool:
    """A transformers key/value cache (``DynamicCache`` and kin), by its shape, not its import."""
    return type(v).__name__.endswith("Cache") and callable(getattr(v, "update", None))


def cache_holds_prefix(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a cache among the arguments already holds tokens."""
    for v in (*args, *kwargs.values()):
        if _is_cache(v):
            length = getattr(v, "get_seq_length", None)
            try:
                if callable(length) and int(length()) > 0:
                    return True
            except Exception:  # an unknown cache: assume it holds something
                return True
    return False


def checkpointed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a block called now is checkpointed by the model itself: under another's
    saved-tensor hooks (see [innermost hooks] in runtime/hook_stack.py), or under ``no_grad``
    with an input computed on the graph (reentrant checkpointing; an evaluation's inputs are
    computed off it, and a leaf that requires grad, learned latents, says nothing either way)."""
    if torch.is_grad_enabled():
        return not saves_reach_offloadd()
    return any(
        isinstance(a, torch.Tensor) and a.grad_fn is not None for a in (*args, *kwargs.values())
    )


def warn_checkpointed(model: nn.Module | None) -> None:
    log.warning(
        "offloadd: budget: %s checkpoints its blocks itself (torch.utils.checkpoint, "
        "gradient_checkpointing): what they save never reaches offloadd, so the budget plans "
        "only what is saved between them; to let offloadd keep, offload or recompute the "
        "blocks, turn the model's checkpointing off",
        type(model).__name__,
    )


def run_checkpointed(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``forward(*args, **kwargs)`` under non-reentrant checkpointing, RNG state preserved."""
    args = tuple(None if _is_cache(v) else v for v in args)
    kwargs = {k: (None if _is_cache(v) else v) for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    keys = list(kwargs)
    n = len(args)

    def positional(*flat: Any) -> Any:
        return forward(*flat[:n], **dict(zip(keys, flat[n:], strict=True)))

    return checkpoint(
        positional, *args, *kwargs.values(), use_reentrant=False, preserve_rng_state=True
    )


# Note [planned blocks under compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A block compiled on its own (``block.compile()``) compiles its hooks and forward with it.
# Traced, the planner's hooks and this decision put guards on the planner's state (a block's
# start time, its step's plan), which changes every step: the block recompiled each step
# until dynamo's recompile limit, then ran eagerly, on other kernels than the compiled block
# without offloadd (the seams grid's budget x compile-block cells: "loaded weights not used").
# They run outside the graph instead (``unseen``, which is ``torch.compiler.disable`` without
# importing dynamo with offloadd: see [invisible to dynamo] in runtime/compiled.py): the graph
# guards only on the decision's outcome, whether this forward is recomputed.


@unseen
def _recompute_now(module: nn.Module) -> bool:
    ref = module.__dict__.get(_ATTR)
    planner = ref[0]() if ref is not None else None
    return planner is not None and ref is not None and bool(planner.recompute_now(ref[1]))


def _subclass(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        base_forward = cls.forward  # type: ignore[attr-defined]

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if _recompute_now(self):
                return run_checkpointed(lambda *a, **kw: base_forward(self, *a, **kw), args, kwargs)
            return base_forward(self, *args, **kwargs)

        sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        _SUBCLASSES[cls] = sub
    return sub


def install(module: nn.Module, planner: Any, k: int) -> None:
    """Make ``module`` (block ``k``) ask ``planner`` at each forward (see [recompute wrapper])."""
    module.__dict__[_ATTR] = (weakref.ref(planner), k)
    if type(module) not in _SUBCLASSES.values():
        module.__class__ = _subclass(type(module))


def remove(module: nn.Module) -> None:
    """Undo :func:`install` (the original class back, if it is still ours)."""
    module.__dict__.pop(_ATTR, None)
    cls = type(module)
    for base, sub in _SUBCLASSES.items():
        if sub is cls:
            module.__class__ = base
            return
