"""The planner's gradient hooks on tensors: at most one on a tensor, none holding the planner.

Note: [one hook per tensor] The planner learns from tensor hooks where a step's backward is: the
gradient at the first block's input ends a raced step's time and a measured step's window
(planner.py), and in a profile step the gradients at each block's input and at the last block's
output time the blocks' backwards (profile.py). The first block's input may be the same tensor
every step: a leaf such as learned latents or queries passed straight in, whose hooks live as
long as it does. A hook added per step would pile up on it, each one called by every backward
and each holding the planner. So :class:`GradHooks` puts at most one hook on a tensor, and what
that hook does is set per step: one ``mark`` (a step's replaces the one before it on a tensor seen
again, and ``None`` clears it), then the records added with ``once``, each run by the first
backward that reaches the tensor. A hook with nothing left to do removes itself; ``clear`` (the
planner's ``detach``) removes them all. Marks reach the planner through :func:`weakly`: a tensor
the user keeps never keeps a planner alive.

Under ``torch.compile`` the planner adds no mark, and a record is a plain hook on the traced
tensor, as dynamo expects (those tensors are a graph's own, never a leaf the user keeps).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["GradHook", "GradHooks", "weakly"]

GradHook = Callable[[torch.Tensor], None]


def weakly(method: Callable[..., None], *args: Any) -> GradHook:
    """``method(grad, *args)`` while the object ``method`` is bound to lives, else nothing."""
    ref = weakref.WeakMethod(method)

    def call(grad: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(grad, *args)

    return call


class _Hook:
    """The one hook on a tensor: its mark, then its records run once (see the module Note)."""

    __slots__ = ("handle", "mark", "once")

    def __init__(self) -> None:
        self.mark: GradHook | None = None
        self.once: list[GradHook] = []
        self.handle: Any = None  # torch's RemovableHandle while registered

    def __call__(self, grad: torch.Tensor) -> None:
        once, self.once = self.once, []
        if self.mark is not None:
            self.mark(grad)
        for record in once:
            record(grad)
        self.remove_if_idle()

    def remove_if_idle(self) -> None:
        if self.mark is None and not self.once:
            self.remove()

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()  # inside the hook too: torch iterates over a copy
            self.handle = None


class GradHooks:
    """At most one gradient hook per tensor (see [one hook per tensor])."""

    def __init__(self) -> None:
        self._on: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _hook(self, t: torch.Tensor) -> _Hook:
        hook = self._on.get(t)
        if hook is None or hook.handle is None:
            hook = _Hook()
            hook.handle = t.register_hook(hook)
            self._on[t] = hook
        return hook

    def mark(self, t: torch.Tensor, mark: GradHook | None) -> None:
        """What the gradient reaching ``t`` does for this step (None: nothing)."""
        if mark is not None:
            self._hook(t).mark = mark
            return
        hook = self._on.get(t)
        if hook is not None:
            hook.mark = None
            hook.remove_if_idle()

    def once(self, t: torch.Tensor, record: GradHook) -> None:
        """``record(grad)`` when the gradient first reaches ``t``."""
        if torch.compiler.is_compiling():
            t.register_hook(record)
            return
        self._hook(t).once.append(record)

    def clear(self) -> None:
        """Remove every hook (the planner detaches)."""
        for hook in list(self._on.values()):
            hook.remove()
        self._on.clear()
