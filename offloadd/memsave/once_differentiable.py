"""``once_differentiable`` for memsave's backward functions, without its cost where it does nothing.

torch's ``once_differentiable`` runs the backward under ``no_grad`` and, when grad mode is on
(``backward(create_graph=True)``), makes the gradients it returns raise on a second
differentiation (Note [double backward] in :mod:`offloadd.memsave.pointwise`). In an ordinary
backward the engine has already turned grad mode off, and the wrapper then only enters and
leaves ``no_grad`` around a call that would run the same without it: a few microseconds for each
of the two hundred memsaved calls of a ResNet-101 step. This wrapper calls the function directly
in that case and torch's wrapper otherwise, so the behaviour is torch's in both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.autograd import function as _function

__all__ = ["once_differentiable"]

_F = TypeVar("_F", bound=Callable[..., Any])


def once_differentiable(fn: _F) -> _F:
    """torch's ``once_differentiable``, calling ``fn`` directly while grad mode is off."""
    guarded = _function.once_differentiable(fn)

    @functools.wraps(fn)
    def wrapper(ctx: Any, *args: Any) -> Any:
        if torch.is_grad_enabled():  # create_graph=True: a second backward must raise
            return guarded(ctx, *args)
        return fn(ctx, *args)

    return wrapper  # type: ignore[return-value]
