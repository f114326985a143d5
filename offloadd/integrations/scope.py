"""Where environment activation offloads: the outermost training call of a module.

Note: [scope rule] Two global module hooks keep a thread-local stack of the module calls in
progress. When a call starts on an empty stack (the *outermost* call) and all of these hold, the
offload scope is entered, and it is left when that same call returns or raises:

- grad mode is on (not ``torch.no_grad()``/``inference_mode()``) and the module is in training
  mode (``model.train()``): evaluation forwards are untouched;
- the module holds parameters: a loss module (``nn.CrossEntropyLoss()``) called on the model's
  output is not the model, and loss code outside the model stays untouched;
- no backward is running on this thread: the recomputation that ``torch.utils.checkpoint``
  runs inside backward needs its own hooks, and its tensors are used at once anyway;
- no ``torch.func`` transform is active (they refuse saved-tensor hooks), saved-tensor hooks
  are not disabled, and no other saved-tensor hooks are active: hooks the program installed
  itself (``save_on_cpu``, an explicit :class:`~offloadd.Offloader`) keep precedence;
- not while Dynamo traces (``torch.compile``): the hooks then do nothing at all.

Every forward is its own scope and the offloader lets any number of forwards precede their
backwards, so gradient accumulation and pipeline schedules (several micro-batches forward, then
their backwards, in any order) work unchanged. Threads are independent (``DataParallel``
replicas each open their own scope).

The forward hook is registered with ``always_call=True``, so PyTorch also runs it when the
forward raises an ``Exception``; the scope is then closed before the exception propagates. A
``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``) skips module hooks in
PyTorch itself; offloadd then leaves the scope open, which only matters to a program that
catches the interrupt and keeps training.

Note: [compile's warning] ``torch.compile(model)`` warns, at each call of the compiled model,
that global module hooks "fire an extra time" for its wrapper, the ``OptimizedModule``. For
these two hooks that is no fault: the wrapper's call is the outermost, the model's inside it is
not, and the scope is entered once (tests/integrations check it, compiled and eager). So while
they are installed, the one function that warning asks (``_has_any_global_hook``, read by
nothing else in PyTorch) leaves them out, and still answers True for any global hook of anyone
else. It is replaced only where it reads exactly the six hook tables of the PyTorch this was
written for; elsewhere the warning stays, and says nothing wrong.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleScope"]


def _probe(module: Any, name: str) -> Callable[..., Any] | None:
    fn = getattr(module, name, None)
    return fn if callable(fn) else None


_HOOK_TABLES = (
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)


def _others_than(ours: Callable[[], set[int]]) -> Callable[[], bool] | None:
    """``_has_any_global_hook`` leaving out the hooks ``ours()`` names (see [compile's
    warning]); None where PyTorch's reads other tables than ``_HOOK_TABLES``."""
    mod = torch.nn.modules.module
    asks = getattr(mod, "_has_any_global_hook", None)
    code = getattr(asks, "__code__", None)
    if code is None or tuple(code.co_names) != _HOOK_TABLES:
        return None

    def _has_any_global_hook() -> bool:
        skip = ours()
        return any(any(k not in skip for k in getattr(mod, name)) for name in _HOOK_TABLES)

    return _has_any_global_hook


class ModuleScope:
    """Global module hooks that call ``enter(module)`` and ``leave()`` around outermost calls.

    ``enter`` returns whether it entered a scope; ``leave`` is called only after an ``enter``
    that returned True, on the same thread."""

    def __init__(self, enter: Callable[[nn.Module], bool], leave: Callable[[], None]) -> None:
        self._enter = enter
        self._leave = leave
        self._tls = threading.local()
        self._handles: list[Any] = []
        self._asked: Callable[[], bool] | None = None  # PyTorch's, while ours replaces it
        self._asks: Callable[[], bool] | None = None  # ours
        self.enabled = True
        self.scopes = 0
        """Outermost calls that entered a scope (all threads)."""
        # Private PyTorch probes, looked up once; a missing one means that check is skipped.
        self._graph_task_id = _probe(torch._C, "_current_graph_task_id")
        self._interpreter = _probe(torch._C._functorch, "peek_interpreter_stack")
        self._hooks_enabled = _probe(torch._C._autograd, "_saved_tensors_hooks_is_enabled")
        self._top_hooks = _probe(torch._C._autograd, "_top_saved_tensors_default_hooks")

    def install(self) -> None:
        """Register the two global hooks (once)."""
        if self._handles:
            return
        mod = torch.nn.modules.module
        self._handles = [
            mod.register_module_forward_pre_hook(self._pre_hook),
            mod.register_module_forward_hook(self._post_hook, always_call=True),
        ]
        asks = _others_than(lambda: {h.id for h in self._handles})
        if asks is not None:  # see [compile's warning]
            self._asked = mod._has_any_global_hook
            self._asks = asks
            mod._has_any_global_hook = asks

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._asked is not None:
            mod = torch.nn.modules.module
            if mod._has_any_global_hook is self._asks:  # not replaced by someone since
                mod._has_any_global_hook = self._asked
            self._asked = None

    def _stack(self) -> list[nn.Module]:
        stack: list[nn.Module] | None = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
            self._tls.entered = False
        return stack

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        stack = self._stack()
        stack.append(module)
        if len(stack) == 1 and self.enabled and self.qualifies(module):
            self._tls.entered = self._enter(module)
            if self._tls.entered:
                self.scopes += 1

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        stack = self._stack()
        # The top is this call unless our pre-hook did not run for it (an earlier pre-hook
        # raised); then there is nothing to pop.
        if not stack or stack[-1] is not module:
            return
        stack.pop()
        if not stack and self._tls.entered:
            self._tls.entered = False
            self._leave()

    def qualifies(self, module: nn.Module) -> bool:
        """Whether an outermost call of ``module`` right now is a training forward to offload."""
        if not (torch.is_grad_enabled() and module.training):
            return False
        if self._graph_task_id is not None and self._graph_task_id() != -1:
            return False  # inside backward: checkpoint recomputation
        if self._interpreter is not None and self._interpreter() is not None:
            return False  # torch.func transform
        if self._hooks_enabled is not None and not self._hooks_enabled():
            return False
        if self._top_hooks is not None and self._top_hooks(False) is not None:
            return False  # the program's own saved-tensor hooks win
        return next(module.parameters(), None) is not None
