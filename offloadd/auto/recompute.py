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

Note: [recomputed state] A recomputation is exact only if the block's forward computes the same
from the same inputs, parameters, buffers and RNG. ``torch.utils.checkpoint`` restores torch's
RNG; three more layers cover the rest, since the planner, not the user, chose to recompute:
- Python's ``random`` and NumPy's global generator are restored for the recomputation too, and
  set back to where they were after it (a block that draws from them recomputes exactly, and
  the script's own draws are not moved).
- The profile step records, per block, its modules' plain attributes (numbers, strings: a call
  counter, a schedule) and the version of their tensors that are not parameters or buffers; a
  block whose forward changed one is never recomputed (profile.py, ``module_state``).
- What is left (a global, a closure, a kernel that is not deterministic) is caught, not
  prevented: the forward's outputs are fingerprinted (their bits summed, as integers, which is
  exact for NaN and -0) and the recomputation's outputs must give the same. If they do not,
  backward raises :class:`RecomputeMismatch` naming the block rather than computing gradients
  from other activations, and the planner never recomputes that block again (so too where
  torch's own check raises ``CheckpointError`` first: the recomputation saved more tensors).
  So the recomputation runs to its end (``early_stop=False``: it recomputes what follows the
  block's last saved tensor, usually an add, a transient the plan's recompute peak already
  holds: the block's whole forward). On an accelerator the check runs only under
  ``torch.use_deterministic_algorithms(True)`` (``_checked_here``), with one sync a recomputed
  block. Under ``torch.compile`` none of this runs: a compiled recomputation replays the
  graph's tensor ops, not the Python around them.
"""

from __future__ import annotations

import logging
import random
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointError, checkpoint

from offloadd.runtime.compiled import unseen
from offloadd.runtime.hook_stack import saves_reach_offloadd

__all__ = [
    "RecomputeMismatch",
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


class RecomputeMismatch(RuntimeError):
    """A recomputed block gave other outputs than its forward did (Note [recomputed state])."""


def _host_rngs() -> tuple[Any, Any]:
    """The states of Python's ``random`` and, where NumPy is loaded, its global generator."""
    np = sys.modules.get("numpy")
    return random.getstate(), (np.random.get_state() if np is not None else None)


def _set_host_rngs(states: tuple[Any, Any]) -> None:
    random.setstate(states[0])
    np = sys.modules.get("numpy")
    if np is not None and states[1] is not None:
        np.random.set_state(states[1])


_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(value: Any) -> list[torch.Tensor]:
    """Per tensor in ``value`` (a tensor, or a structure of them): the sum of its elements' bits
    read as integers, so equal bits give equal sums, NaN and -0 included."""
    out = []
    with torch.no_grad():
        for t in tree_leaves(value):
            if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
                continue
            if t.is_complex():
                t = torch.view_as_real(t)
            if t.dtype is not torch.bool:
                t = t.view(_AS_INT[t.element_size()])
            out.append(t.sum())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal fingerprints: one comparison per device (on CUDA, one sync)."""
    if len(a) != len(b):
        return False
    devices: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for x, y in zip(a, b, strict=True):
        if x.device != y.device:
            return False
        devices.setdefault(x.device, []).append((x, y))
    return all(
        torch.equal(torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs]))
        for pairs in devices.values()
    )


def _checked_here(value: Any) -> bool:
    """Whether a block's outputs are fingerprinted: on the CPU always, on an accelerator only
    where the user asked for deterministic kernels (``torch.use_deterministic_algorithms``).
    Without it the same forward may differ in its last bits from run to run (atomics), and
    training without offloadd is not reproducible either; a check there would stop training
    for what plain checkpointing accepts, and cost a sync."""
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            return torch.are_deterministic_algorithms_enabled()
    return True


def run_checked(
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str,
    on_mismatch: Callable[[], None],
) -> Any:
    """:func:`run_checkpointed`, its recomputation checked (Note [recomputed state]): Python's
    and NumPy's RNG restored for it, its outputs compared with the forward's; on a difference
    ``on_mismatch()`` is called and :class:`RecomputeMismatch` raised, naming block ``name``."""
    rngs = _host_rngs()
    seen: list[list[torch.Tensor]] = []

    def checked(*a: Any, **kw: Any) -> Any:
        if not seen:  # the forward
            out = forward(*a, **kw)
            seen.append(fingerprint(out) if _checked_here(out) else [])
            return out
        now = _host_rngs()  # the recomputation, in backward
        _set_host_rngs(rngs)
        try:
            out = forward(*a, **kw)
        except CheckpointError:  # it saved more tensors than the forward: it differs too
            on_mismatch()
            raise
        finally:
            _set_host_rngs(now)
        if seen[0] and not _same(seen[0], fingerprint(out)):
            on_mismatch()
            raise RecomputeMismatch(
                f"offloadd: budget: block {name} gave other outputs when recomputed in backward "
                "than in forward, so its gradients would not be exact; backward stops here. Its "
                "forward depends on more than its inputs, parameters, buffers and RNG (a global, "
                "a closure, a kernel that is not deterministic: torch.use_deterministic_"
                "algorithms). offloadd will not recompute it again in this process; to keep a "
                "new run from recomputing it, make what it reads an input or a buffer"
            )
        return out

    return run_checkpointed(checked, args, kwargs, early_stop=False)


def run_checkpointed(
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    early_stop: bool = True,
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
        positional,
        *args,
        *kwargs.values(),
        use_reentrant=False,
        preserve_rng_state=True,
        early_stop=early_stop,
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


def _run_checked(module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    planner_ref, k = module.__dict__[_ATTR]
    planner = planner_ref()
    name = planner.names[k] if planner is not None else type(module).__name__

    def mismatch() -> None:
        p = planner_ref()
        if p is not None:
            p.never_recompute(k)

    return run_checked(forward, args, kwargs, name, mismatch)


def _subclass(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        base_forward = cls.forward  # type: ignore[attr-defined]

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if _recompute_now(self):
                run = lambda *a, **kw: base_forward(self, *a, **kw)  # noqa: E731
                if torch.compiler.is_compiling():  # see [recomputed state]
                    return run_checkpointed(run, args, kwargs)
                return _run_checked(self, run, args, kwargs)
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
