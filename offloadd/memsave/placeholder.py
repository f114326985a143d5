"""A stand-in for a saved input that a backward op reads only the shape of.

Note: [placeholder]
~~~~~~~~~~~~~~~~~~~
Some aten backward ops take the forward's input but, for the gradients asked of them in
``output_mask``, read only its sizes, dtype and device: ``convolution_backward`` without the
weight gradient and ``max_pool*_with_indices_backward`` always (``native_batch_norm_backward``
too, but its kernel picks its path by layout: Note [batch norm stand-in] in
:mod:`offloadd.memsave.norm`). Instead of keeping the input alive, memsave passes
them a tensor of one element expanded to the input's shape (every stride 0, so it owns one
element's bytes). Its channel stride is 0, which ``suggest_memory_format`` reads as contiguous
(the layout PyTorch picks for a contiguous input), so the backward runs the same kernel and
returns the same bits; callers use it only for inputs that are contiguous.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["placeholder"]


@functools.lru_cache(maxsize=64)
def _element(ndim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((1,) * ndim, dtype=dtype, device=device)


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` with one element's storage (every stride 0; the element is shared
    by every placeholder of its dtype and device, and never written)."""
    return _element(len(shape), dtype, device).expand(shape)
