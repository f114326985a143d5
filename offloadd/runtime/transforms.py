"""``torch.func`` and an Offloader's scope: which transforms compose, and the error for the rest.

Note [torch.func in a scope]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The transforms that run their own autograd level (``torch.func.grad``, ``grad_and_value``,
``vjp``, ``jacrev``, ``hessian``) refuse saved-tensor hooks: torch wraps them in
``torch.autograd.graph.disable_saved_tensors_hooks``, which raises at once if hooks are already
installed, and makes any later push of hooks raise. So with torch 2.13:

- a transform called inside ``with off:`` raises torch's ``RuntimeError`` ("torch.func.{grad,
  vjp, jacrev, hessian} don't yet support saved tensor hooks. Please open an issue ...") when
  it is called, before any op ran: pack never sees a tensor of it;
- ``with off:`` inside a transformed function raises the same error when the scope is entered.

Neither can give a wrong result, but torch's message does not say what to do. :func:`check_enter`
(before the scope pushes its hooks) and :func:`refusal` (for the exception leaving the scope)
turn both into :class:`TransformRefused`, which names torch.func and the remedy, chained to
torch's error. Anything else passes through unchanged.

The other transforms compose: ``vmap``, ``jvp``, ``jacfwd``, ``functionalize`` and
``functional_call`` leave the hooks alone, and the tensors autograd saves under them reach pack
as plain tensors (the autograd level sits below functorch's wrappers), so they are moved and
come back bit-identical like any other (tests/properties/test_matrix.py), with one exception:

Note [zero tangents]
~~~~~~~~~~~~~~~~~~~~
Forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) gives a tensor
that has no tangent, such as a weight, a *zero tensor* as its tangent: a plain strided
``torch.Tensor`` of full size whose storage is invalid. With a backward after it (forward over
reverse), the tangent formulas save it, e.g. ``linear``'s weight tangent transposed, 256 KiB
for a 512 x 128 weight. Pack then takes it for an activation to move and fails on its storage
("Attempted to access the data pointer on an invalid python storage."). It holds no memory and
is rebuilt by nothing: :func:`holds_no_bytes` tells pack to keep it, counted as 0 bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TransformRefused", "check_enter", "holds_no_bytes", "refusal"]

# What torch 2.13's refusal says (torch/_functorch/vmap.py, doesnt_support_saved_tensors_hooks).
_TORCH_SAYS = "don't yet support saved tensor hooks"

_REMEDY = (
    "offloadd: torch.func.grad, grad_and_value, vjp, jacrev and hessian refuse saved-tensor "
    "hooks, and an Offloader's scope installs them ({where}). Call the transform outside "
    "`with off:` (and do not enter the Offloader inside the transformed function), or take the "
    "gradient with loss.backward() / torch.autograd.grad inside the scope. torch.func.vmap, jvp, "
    "jacfwd, functionalize and functional_call compose with the scope. torch said: {said}"
)


class TransformRefused(RuntimeError):
    """A ``torch.func`` transform and an Offloader's scope met (see [torch.func in a scope])."""


def _disabled_message() -> str | None:
    """Why saved-tensor hooks are disabled on this thread now, or None if they are not."""
    autograd = torch._C._autograd
    is_enabled: Callable[[], bool] | None = getattr(
        autograd, "_saved_tensors_hooks_is_enabled", None
    )
    if is_enabled is None or is_enabled():
        return None
    get: Callable[[], str | None] | None = getattr(
        autograd, "_saved_tensors_hooks_get_disabled_error_message", None
    )
    message = get() if get is not None else None
    return message or ""


def check_enter() -> None:
    """Raise :class:`TransformRefused` if a ``torch.func`` transform that refuses saved-tensor
    hooks is running on this thread: call it before an Offloader pushes its hooks. Hooks
    disabled for another reason are left to torch's own error."""
    said = _disabled_message()
    if said is not None and "torch.func" in said:
        raise TransformRefused(_REMEDY.format(where="entered inside the transform", said=said))


def refusal(exc: object) -> TransformRefused | None:
    """For the exception leaving an Offloader's scope: the :class:`TransformRefused` to raise
    instead (caused by ``exc``) if it is torch's refusal of a ``torch.func`` transform called
    in the scope, else None (``exc`` goes on as it is)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, TransformRefused):
        return None
    said = str(exc)
    if _TORCH_SAYS not in said or "torch.func" not in said:
        return None
    err = TransformRefused(_REMEDY.format(where="the transform was called inside it", said=said))
    err.__cause__ = exc
    return err


def holds_no_bytes(t: torch.Tensor) -> bool:
    """Whether ``t`` is a zero tensor, which has no storage to move (see [zero tangents])."""
    return bool(t._is_zerotensor())
