"""Stand-ins for a saved input that a backward op reads only the shape of.

Note: [placeholder]
~~~~~~~~~~~~~~~~~~~
Some aten backward ops take the forward's input but, for the gradients asked of them in
``output_mask``, read only its sizes, dtype, device and layout: ``convolution_backward`` without
the weight gradient and ``max_pool*_with_indices_backward`` always (``native_batch_norm_backward``
too, but its kernel picks its path by layout: Note [batch norm stand-in] in
:mod:`offloadd.memsave.norm`). Instead of keeping the input alive, memsave passes them a
stand-in, made in backward and dropped right after the call:

- :func:`placeholder`, for the pooling backward: one element expanded to the input's shape (every
  stride 0, so it owns one element's bytes). Its channel stride is 0, which
  ``suggest_memory_format`` reads as contiguous, the layout PyTorch picks for a contiguous input.
- :func:`uninitialised`, for ``convolution_backward``: a contiguous tensor that is never written
  or read. ``convolution_backward`` hands every backend ``input.contiguous(memory_format)``,
  which turns an expanded placeholder into a full copy of the input's size, a sizeable share of
  the convolution's own backward at every frozen convolution
  (docs/benchmarks/memsave_kernels_cpu-2core_2026-11-24.md). An uninitialised tensor is already
  contiguous: it costs an allocation, and on the CPU not even its pages (nothing touches them).
  On a GPU it takes the input's bytes from the caching allocator for the duration of the call,
  which the backend's copy would have taken too.

Callers use them only for inputs that are contiguous, so the backward runs the same kernel as
plain PyTorch's and returns the same bits (the tests compare them).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["placeholder", "uninitialised"]


@functools.lru_cache(maxsize=64)
def _element(ndim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((1,) * ndim, dtype=dtype, device=device)


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` with one element's storage (every stride 0; the element is shared
    by every placeholder of its dtype and device, and never written)."""
    return _element(len(shape), dtype, device).expand(shape)


def uninitialised(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous tensor of ``shape`` whose contents are never to be read (``torch.empty``)."""
    return torch.empty(shape, dtype=dtype, device=device)
