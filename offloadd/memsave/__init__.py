"""Selective differentiation: modules that save for backward only what the gradients that will be
computed read. :func:`memsave` swaps a model's supported modules in place (Note [class swap] in
:mod:`offloadd.memsave.replace`).

| module | role |
|---|---|
| ``bits`` | packing bool masks eight to a byte |
| ``kernels`` | the native kernels: ReLU with its mask, masks, pooling offsets (csrc/memsave/) |
| ``placeholder`` | stand-ins for an input a backward reads the shape of |
| ``conv`` | Conv1d/2d/3d, ConvTranspose1d/2d/3d: the input only for the weight's gradient |
| ``norm`` | BatchNorm1d/2d/3d in eval mode: the input only for the weight's gradient |
| ``pointwise`` | ReLU, LeakyReLU, Dropout: bit masks |
| ``pool`` | MaxPool1d/2d/3d: window offsets, no input |
| ``frozen_gate`` | masks off while every parameter is trainable (Note [fully trainable]) |
| ``once_differentiable`` | torch's, without its cost in an ordinary backward |
| ``replace`` | :func:`memsave`, :func:`unmemsave` |

The package itself is light (``import offloadd`` imports it): its names are imported from
``replace`` on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offloadd.memsave.replace import REPLACEMENTS, memsave, unmemsave

__all__ = ["REPLACEMENTS", "memsave", "unmemsave"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("offloadd.memsave.replace"), name)
    globals()[name] = value
    return value
