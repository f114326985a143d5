"""``memsave(model)``: swap the supported modules of a model for their selective versions.

Note: [class swap]
~~~~~~~~~~~~~~~~~~
Each module whose class is exactly one of the supported ``torch.nn`` classes gets its
``__class__`` set to a subclass that only overrides ``forward`` (e.g. ``nn.Conv2d`` ->
:class:`~offloadd.memsave.conv.MemsaveConv2d`). The instance stays the same object: its
parameters, buffers, hooks, ``state_dict`` keys, the references other code holds to it and the
optimizer's parameter groups are untouched, ``isinstance(m, nn.Conv2d)`` still holds, and
``deepcopy``/pickling work (the subclasses live at module level). Subclasses of the supported
classes are left alone: they may override ``forward``. Modules of other classes are left alone
(LayerNorm and GroupNorm included: Note [LayerNorm and GroupNorm] in
:mod:`offloadd.memsave.norm`). The swap is idempotent and :func:`unmemsave` undoes it.

What each saves is decided at every forward from ``requires_grad`` of the input, weight and
bias, so freezing or unfreezing parameters between steps needs no new call. Whatever is saved
goes through ``save_for_backward``, so an :class:`~offloadd.Offloader` around forward sees (and
offloads, dedups) it as it sees plain PyTorch's saved tensors.
"""

from __future__ import annotations

from torch import nn

from offloadd.memsave.conv import (
    MemsaveConv1d,
    MemsaveConv2d,
    MemsaveConv3d,
    MemsaveConvTranspose1d,
    MemsaveConvTranspose2d,
    MemsaveConvTranspose3d,
)
from offloadd.memsave.frozen_gate import Gate
from offloadd.memsave.norm import MemsaveBatchNorm1d, MemsaveBatchNorm2d, MemsaveBatchNorm3d
from offloadd.memsave.pointwise import MemsaveDropout, MemsaveLeakyReLU, MemsaveReLU
from offloadd.memsave.pool import MemsaveMaxPool1d, MemsaveMaxPool2d, MemsaveMaxPool3d

__all__ = ["REPLACEMENTS", "memsave", "unmemsave"]

REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: MemsaveConv1d,
    nn.Conv2d: MemsaveConv2d,
    nn.Conv3d: MemsaveConv3d,
    nn.ConvTranspose1d: MemsaveConvTranspose1d,
    nn.ConvTranspose2d: MemsaveConvTranspose2d,
    nn.ConvTranspose3d: MemsaveConvTranspose3d,
    nn.BatchNorm1d: MemsaveBatchNorm1d,
    nn.BatchNorm2d: MemsaveBatchNorm2d,
    nn.BatchNorm3d: MemsaveBatchNorm3d,
    nn.ReLU: MemsaveReLU,
    nn.LeakyReLU: MemsaveLeakyReLU,
    nn.Dropout: MemsaveDropout,
    nn.MaxPool1d: MemsaveMaxPool1d,
    nn.MaxPool2d: MemsaveMaxPool2d,
    nn.MaxPool3d: MemsaveMaxPool3d,
}
"""Supported class -> its selective subclass (exact classes only)."""

_ORIGINALS = {v: k for k, v in REPLACEMENTS.items()}


def memsave(model: nn.Module) -> nn.Module:
    """Make ``model`` (in place) save for backward only what the gradients that will be computed
    need: every module (``model`` included) whose class is exactly a key of
    :data:`REPLACEMENTS` gets its selective subclass (Note [class swap]), and ``model`` a
    :class:`~offloadd.memsave.frozen_gate.Gate` (Note [fully trainable]: nothing changes while every
    parameter is trainable). Gradients, outputs, running statistics and RNG use are bitwise those
    of the unmodified model. Returns ``model``."""
    gate = _gate(model)
    if gate is None:
        gate = Gate()
        model.register_forward_pre_hook(gate)
    # as of now, not only from the model's next forward: a call already under way (memsave from
    # OFFLOADD_MEMSAVE's global pre-hook) or its submodules called directly never run the hook
    gate(model, ())
    for module in model.modules():
        cls = REPLACEMENTS.get(type(module))
        if cls is not None:
            module.__class__ = cls
        if type(module) in _ORIGINALS:
            module.__dict__["_memsave_gate"] = gate  # a plain attribute (not a submodule)
    return model


def unmemsave(model: nn.Module) -> nn.Module:
    """Undo :func:`memsave` (in place); returns ``model``."""
    for key, hook in list(model._forward_pre_hooks.items()):
        if isinstance(hook, Gate):
            del model._forward_pre_hooks[key]
    for module in model.modules():
        cls = _ORIGINALS.get(type(module))
        if cls is not None:
            module.__class__ = cls
            module.__dict__.pop("_memsave_gate", None)
    return model


def _gate(model: nn.Module) -> Gate | None:
    return next((h for h in model._forward_pre_hooks.values() if isinstance(h, Gate)), None)
