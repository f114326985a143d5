"""Whether a memsaved model has anything frozen: what the mask-saving modules ask first.

Note: [fully trainable]
~~~~~~~~~~~~~~~~~~~~~~~
In a model whose parameters all require grad, selective saving has nothing to leave out: Conv and
BatchNorm with a trainable weight need their input and run plain PyTorch's forward anyway, and a
ReLU's output is saved by the trainable layer after it whatever the ReLU keeps, so a bit mask
there adds bytes and memory passes instead of removing any (ResNet-101 fully trainable:
docs/benchmarks/memsave_cpu-2core_2026-11-24.md). So :func:`~offloadd.memsave.memsave` puts a
:class:`Gate` on the model: a forward pre-hook that, at every forward of the model, notes
whether any of its parameters is frozen (or it has none: a lone ReLU on an input that requires
grad), and the ReLU, LeakyReLU, Dropout and MaxPool replacements run plain PyTorch's forward
while it is off. A fully
trainable model then runs exactly as without memsave (same saved tensors, same speed); freezing a
parameter switches the masks on at the next forward. The gate is set at ``memsave()`` too, so the
forward under way then (``OFFLOADD_MEMSAVE=1`` memsaves from inside the model's first call) and
submodules called directly (``model.backbone(x)``, which never runs the model's hook) see the
model as it was then.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["Gate", "gated_off"]


class Gate:
    """A forward pre-hook of the memsaved model: ``on`` while it has a frozen parameter (or none).

    Shared by the model's swapped modules (their ``_memsave_gate``); a deep copy of the model
    copies it once, with the hook, so the copy's modules follow the copy."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = True

    def __call__(self, model: nn.Module, args: Any) -> None:
        seen = False
        for p in model.parameters():
            if not p.requires_grad:
                self.on = True
                return
            seen = True
        self.on = not seen

    def __getstate__(self) -> tuple[bool]:
        return (self.on,)  # a tuple: pickle skips __setstate__ for a false state

    def __setstate__(self, state: tuple[bool]) -> None:
        (self.on,) = state


def gated_off(module: nn.Module) -> bool:
    """Whether ``module``'s memsaved model is fully trainable just now (Note [fully trainable])."""
    gate = module.__dict__.get("_memsave_gate")
    return gate is not None and not gate.on
