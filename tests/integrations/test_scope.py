"""The scope rule of environment activation (offloadd.integrations.scope), on real modules in this process.

Each test installs a ModuleScope whose enter/leave record what happened, and removes it after.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offloadd.integrations.scope import ModuleScope


class Recorder:
    def __init__(self) -> None:
        self.entered: list[str] = []
        self.left = 0
        self.depth = 0
        self.hooks: list[object] = []

    def enter(self, module: nn.Module) -> bool:
        self.entered.append(type(module).__name__)
        self.depth += 1
        # what the real offloader does: push saved-tensor hooks for the call
        h = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        h.__enter__()
        self.hooks.append(h)
        return True

    def leave(self) -> None:
        self.left += 1
        self.depth -= 1
        self.hooks.pop().__exit__(None, None, None)  # type: ignore[attr-defined]


@pytest.fixture
def rec() -> Iterator[Recorder]:
    r = Recorder()
    scope = ModuleScope(r.enter, r.leave)
    scope.install()
    try:
        yield r
    finally:
        scope.remove()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a(x)
        raise ValueError("boom")


def test_outermost_training_call_only(rec: Recorder) -> None:
    model = Block()
    y = model(torch.randn(2, 8))
    assert rec.entered == ["Block"] and rec.left == 1  # inner Linear calls are not scopes
    nn.MSELoss()(y, torch.zeros_like(y)).backward()  # a loss module holds no parameters
    assert rec.entered == ["Block"]


def test_eval_and_no_grad_are_untouched(rec: Recorder) -> None:
    model = Block()
    with torch.no_grad():
        model(torch.randn(2, 8))
    with torch.inference_mode():
        model(torch.randn(2, 8))
    model.eval()
    model(torch.randn(2, 8))
    assert rec.entered == []


def test_several_forwards_before_backwards(rec: Recorder) -> None:
    model = Block()
    losses = [model(torch.randn(2, 8)).sum() for _ in range(3)]  # pipeline / accumulation
    for loss in (losses[1], losses[0], losses[2]):
        loss.backward()
    assert rec.entered == ["Block"] * 3 and rec.left == 3 and rec.depth == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_in_backward_is_untouched(rec: Recorder, reentrant: bool) -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=reentrant)

    model = Outer()
    x = torch.randn(2, 8, requires_grad=True)
    model(x).sum().backward()
    assert rec.entered == ["Outer"] and rec.left == 1  # recomputation ran no scope
    # A checkpoint around the whole model installs its own hooks first: they win.
    checkpoint(model, x, use_reentrant=False).sum().backward()
    assert rec.entered == ["Outer"]


def test_torch_func_and_foreign_hooks_are_untouched(rec: Recorder) -> None:
    model = Block()
    params = dict(model.named_parameters())
    x = torch.randn(2, 8)

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).sum()

    grads = torch.func.grad(f)(params)
    assert set(grads) == set(params)
    with torch.autograd.graph.save_on_cpu():
        model(x).sum().backward()
    assert rec.entered == []


def test_exception_in_forward_closes_the_scope(rec: Recorder) -> None:
    with pytest.raises(ValueError, match="boom"):
        Boom()(torch.randn(2, 8))
    assert rec.entered == ["Boom"] and rec.left == 1
    Block()(torch.randn(2, 8)).sum().backward()  # still an outermost call afterwards
    assert rec.entered == ["Boom", "Block"] and rec.depth == 0


def test_threads_have_their_own_depth(rec: Recorder) -> None:
    model = Block()
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(5):
                model(torch.randn(2, 8)).sum().backward()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert rec.entered == ["Block"] * 10 and rec.left == 10


@pytest.mark.filterwarnings("error")
def test_compiled_module_stays_correct_and_unwarned(rec: Recorder) -> None:
    """No "global hooks fire an extra time" warning for ours (see [compile's warning])."""
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 8)
    ref = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    compiled = torch.compile(model, backend="aot_eager")
    got = torch.autograd.grad(compiled(x).sum(), list(model.parameters()))
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b)
    # The compiled wrapper's call is the outermost one; inside, Dynamo's traced calls do nothing.
    assert rec.entered == ["Block", "OptimizedModule"] and rec.depth == 0


def test_compile_still_warns_of_anyone_elses_global_hook() -> None:
    """Ours are left out of the question torch.compile's warning asks, nobody else's; and
    PyTorch's own function is back once the scope is removed."""
    mod = torch.nn.modules.module
    theirs = mod._has_any_global_hook
    scope = ModuleScope(lambda m: False, lambda: None)
    scope.install()
    try:
        assert mod._has_any_global_hook is not theirs and not mod._has_any_global_hook()
        handle = mod.register_module_forward_hook(lambda m, a, o: None)
        try:
            assert mod._has_any_global_hook()
            compiled = torch.compile(Block(), backend="eager")
            with pytest.warns(UserWarning, match="global hooks"):
                compiled(torch.randn(2, 8))
        finally:
            handle.remove()
        assert not mod._has_any_global_hook()
    finally:
        scope.remove()
    assert mod._has_any_global_hook is theirs
