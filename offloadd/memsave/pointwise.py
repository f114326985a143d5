"""ReLU and LeakyReLU saving a bit mask, Dropout saving its mask as bits.

What plain PyTorch (2.13, CPU) saves, and what these save instead, when the input requires grad:

- ``ReLU``: the output, for ``threshold_backward(grad, result, 0)`` (``result <= 0 ? 0 :
  grad``). Here: the bits of ``not (result <= 0)``; backward turns them into a tensor in the
  gradient's dtype that is 0 where ``result <= 0`` and positive elsewhere and calls the same
  ``threshold_backward`` on it, so NaN outputs (gradient passes), ``-0.0`` and exact zeros
  (gradient 0) behave as in plain; the tests compare the bits. (``torch.where`` would select
  the same values but is not vectorised on CPU: several times slower.)

Note: [relu mask]
~~~~~~~~~~~~~~~~~
The mask is ``result.bool()``, not ``~(result <= 0)``: a ReLU's result is never below zero, so
the two agree on every value (positive: true; +0.0 and -0.0: false; NaN: true, as ``NaN <= 0``
is false), and on CPU the cast is vectorised where a comparison that yields bool is not (several
times faster: docs/benchmarks/memsave_cpu-2core_2026-11-24.md).

Note: [fused relu]
~~~~~~~~~~~~~~~~~~
The mask above, in torch ops, costs five passes over memory in forward (the cast, the packing)
and four in backward (unpacking, the conversion to the gradient's dtype), where plain's ReLU
makes one each way (part of memsave's first step-time overhead on ResNet-101 with frozen
convolutions: docs/benchmarks/memsave_cpu-2core_2026-11-24.md). On contiguous float32 CPU
tensors, memsave's kernels
(:mod:`offloadd.memsave.kernels`, csrc/memsave/kernels.cpp) compute the ReLU and its bits in the one pass plain makes (torch's own
``max(0, x)`` instruction, so NaN payloads and -0.0 come out as torch's) and backward's
``result <= 0 ? 0 : grad`` from the bits in one pass; bfloat16 gets the bits in one pass and
``threshold_backward`` on a mask expanded in one pass (torch's bfloat16 kernel rewrites NaN
gradients, and only it knows which). Anything else, or no kernels, takes the torch ops; the
tests compare both paths with plain PyTorch bit for bit.

- ``LeakyReLU``: the input (or, in place, the output); ``leaky_relu_backward`` reads only
  ``self > 0``. Here: those bits; backward calls ``leaky_relu_backward`` on a 0/1 tensor.
- ``Dropout`` (on CPU ``dropout`` is ``input * noise`` with ``noise`` a full tensor of 0 and
  ``1 / (1 - p)`` in the input's dtype, saved by ``MulBackward0``): the same ``noise`` is drawn by
  the same ops (``empty_like(x).bernoulli_(1 - p)``, then ``div_(1 - p)``), so a seed gives the
  same mask and the same RNG state after; the bits of ``noise != 0`` are saved and backward
  rebuilds ``noise`` with the same ops. Dropout1d/2d/3d and AlphaDropout are left untouched
  (their noise is per channel, already small); so is Dropout on devices other than the CPU
  (``native_dropout`` there, a different graph).

Note: [in place]
~~~~~~~~~~~~~~~~
``ReLU(inplace=True)`` (as in ResNets) and ``LeakyReLU(inplace=True)`` stay in place: the
function modifies its input and marks it dirty (``ctx.mark_dirty``), so the output is the input
tensor, as in plain PyTorch, with the same aliasing and the same errors (a leaf that requires
grad cannot be modified in place). One difference: the version counter advances by 2 rather than
1 (the op's own bump and ``mark_dirty``'s); saved-tensor checks compare a version with the one
saved, so nothing observable changes. In place LeakyReLU with a slope ``<= 0`` is left to plain
PyTorch, which refuses its backward.

Note: [gradient layout]
~~~~~~~~~~~~~~~~~~~~~~~
The same values in another layout are not the same gradient: a BatchNorm or a sum before these
layers reduces in memory order, so a gradient with other strides gives other bits. Plain's
backward allocates its result after its operands' strides (TensorIterator: the first operand
whose strides order two dimensions decides): ``threshold_backward`` and
``leaky_relu_backward`` after the saved tensor's first, then the gradient's; Dropout's ``grad *
noise`` after the gradient's first, then the noise's. So the mask stands in with the saved
tensor's strides, where those are not contiguous (channels_last: a frozen stem's BatchNorm, then
a ReLU), and backward then lets the op allocate as plain's does; a contiguous saved tensor keeps
the paths above (the fused kernel, the result written over the mask).

A fully trainable model runs plain PyTorch's forward in these modules: Note [fully trainable] in
:mod:`offloadd.memsave.frozen_gate`.

Note: [double backward]
~~~~~~~~~~~~~~~~~~~~~~~
All memsave functions are ``once_differentiable``: a first backward is exact (also with
``create_graph=True``); differentiating the gradients they return raises PyTorch's "trying to
differentiate twice a function that was marked with @once_differentiable" error rather than
giving a wrong second derivative. Where memsave runs plain PyTorch's forward (a conv with a
trainable weight, BatchNorm in train mode) double backward works as in plain. Do not memsave a
model trained with a gradient penalty through frozen layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offloadd.memsave.bits import pack_bits, unpack_bits, unpack_flags
from offloadd.memsave.frozen_gate import gated_off
from offloadd.memsave.kernels import DTYPES, native, node_kernels, serves
from offloadd.memsave.once_differentiable import once_differentiable

__all__ = [
    "MemsaveDropout",
    "MemsaveLeakyReLU",
    "MemsaveReLU",
    "dropout_bits",
    "leaky_relu_bits",
    "relu_bits",
]


_THRESHOLD_BACKWARD = torch.ops.aten.threshold_backward.grad_input
_LEAKY_RELU_BACKWARD = torch.ops.aten.leaky_relu_backward.grad_input
_THRESHOLD = torch.ops.aten.threshold_backward.default
_LEAKY = torch.ops.aten.leaky_relu_backward.default


def _wants_graph(x: torch.Tensor, inplace: bool) -> bool:
    """Whether memsave's function should run: a graph is built, and the op is not one that
    plain PyTorch refuses (in place on a leaf that requires grad: plain raises before it writes,
    where a function's ``mark_dirty`` raises only after its forward wrote)."""
    return torch.is_grad_enabled() and x.requires_grad and not (inplace and x.is_leaf)


def _expand(
    packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype, ones: bool = True
) -> torch.Tensor:
    """The mask as a contiguous tensor of ``dtype``: 1 (with ``ones=False``, any value > 0)
    where the bit is set, 0 elsewhere."""
    k = native()
    if k is not None and dtype in DTYPES:
        return k.expand(packed, shape, dtype)
    if ones:
        return unpack_bits(packed, shape).to(dtype)
    return unpack_flags(packed, shape).to(dtype)  # one pass fewer


def _strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """``t``'s strides where it is not contiguous, else None: Note [gradient layout]."""
    return None if t.is_contiguous() else t.stride()


def _laid_out(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``t`` (contiguous) dense, its dimensions in the memory order of ``stride``: what decides
    the layout plain's op allocates (a slice's gaps would only cost memory)."""
    order = sorted(range(t.dim()), key=lambda d: -stride[d])  # outermost first; ties stay
    out = torch.empty([t.shape[d] for d in order], dtype=t.dtype, device=t.device)
    return out.permute([order.index(d) for d in range(t.dim())]).copy_(t)


def _pack(t: torch.Tensor, positive: bool) -> torch.Tensor:
    """The packed bits of ``t > 0`` if ``positive``, else of ``not (t <= 0)``."""
    k = native() if serves(t) else None
    if k is not None:
        return k.pack(t, positive)
    return pack_bits(t > 0 if positive else t.bool())  # Note [relu mask]


class _ReLUBits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        # reached only where the C++ function cannot serve x (relu_bits): torch ops
        out = torch.relu_(x) if inplace else torch.relu(x)
        packed = pack_bits(out.bool())  # not (result <= 0), as a cast: Note [relu mask]
        if inplace:
            ctx.mark_dirty(x)
        ctx.shape, ctx.stride = out.shape, _strides(out)
        ctx.save_for_backward(packed)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (packed,) = ctx.saved_tensors
        k = native() if serves(grad) and grad.dtype == torch.float32 else None
        if k is not None and ctx.stride is None:  # threshold_backward's, one pass: [fused relu]
            return k.select(grad, packed), None
        passes = _expand(packed, ctx.shape, grad.dtype, ones=False)  # 0 where result <= 0
        if ctx.stride is not None:  # Note [gradient layout]
            return _THRESHOLD(grad, _laid_out(passes, ctx.stride), 0), None
        # written over ``passes`` (elementwise, same positions): one new tensor, as in plain
        return _THRESHOLD_BACKWARD(grad, passes, 0, grad_input=passes), None


class _LeakyReLUBits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slope: float, inplace: bool) -> torch.Tensor:
        positive = _pack(x, positive=True)
        out = F.leaky_relu(x, slope, inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.shape, ctx.stride = out.shape, _strides(x)  # plain saves x (or out: x, in place)
        ctx.slope = slope
        ctx.save_for_backward(positive)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (packed,) = ctx.saved_tensors
        sign = _expand(packed, ctx.shape, grad.dtype, ones=False)  # > 0 exactly where self > 0
        if ctx.stride is not None:  # Note [gradient layout]
            return _LEAKY(grad, _laid_out(sign, ctx.stride), ctx.slope, False), None, None
        return _LEAKY_RELU_BACKWARD(grad, sign, ctx.slope, False, grad_input=sign), None, None


def _noise(like: torch.Tensor, p: float) -> torch.Tensor:
    """``noise`` as ATen's CPU ``dropout`` draws it (same ops, same RNG use)."""
    return torch.empty_like(like).bernoulli_(1 - p)


class _DropoutBits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
        noise = _noise(x, p)
        packed = _pack(noise, positive=False)  # noise is 0 or 1 here
        noise.div_(1 - p)
        if inplace:
            ctx.mark_dirty(x)
            out = x.mul_(noise)
        else:
            out = x * noise
        ctx.shape, ctx.stride = noise.shape, _strides(noise)
        ctx.p = p
        ctx.save_for_backward(packed)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (packed,) = ctx.saved_tensors
        noise = _expand(packed, ctx.shape, grad.dtype)  # 0 or 1
        if ctx.stride is not None:  # Note [gradient layout]
            noise = _laid_out(noise, ctx.stride)
        return grad * noise.div_(1 - ctx.p), None, None


def relu_bits(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu(x, inplace)`` saving one bit per element for backward."""
    if not _wants_graph(x, inplace):
        return F.relu(x, inplace)
    k = node_kernels() if serves(x) else None
    if k is not None:  # the same function in C++: Note [C++ functions] in kernels.py
        out: torch.Tensor = k.relu_bits_(x) if inplace else k.relu_bits(x)
        return out
    out = _ReLUBits.apply(x, inplace)
    return out


def leaky_relu_bits(x: torch.Tensor, slope: float = 0.01, inplace: bool = False) -> torch.Tensor:
    """``F.leaky_relu(x, slope, inplace)`` saving one bit per element for backward."""
    if not _wants_graph(x, inplace) or (inplace and slope <= 0):
        return F.leaky_relu(x, slope, inplace)
    out: torch.Tensor = _LeakyReLUBits.apply(x, slope, inplace)
    return out


def dropout_bits(
    x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout(x, p, training, inplace)`` saving its mask as bits (CPU; else plain).

    Plain while dynamo traces: a compiled graph draws its random numbers with inductor's own
    generator, and this function's draws (``bernoulli_``, as ATen's eager CPU dropout makes
    them) would be other numbers there than the compiled ``dropout`` of the model without
    memsave; the graph then holds the model's own dropout, whose mask inductor saves itself."""
    plain = not training or p <= 0 or p >= 1 or x.numel() == 0 or x.device.type != "cpu"
    plain = plain or torch.compiler.is_compiling()
    if plain or not _wants_graph(x, inplace):
        return F.dropout(x, p, training, inplace)
    out: torch.Tensor = _DropoutBits.apply(x, p, inplace)
    return out


class MemsaveReLU(nn.ReLU):
    """:class:`torch.nn.ReLU` whose backward keeps a bit mask (:func:`relu_bits`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if gated_off(self):  # Note [fully trainable]
            return F.relu(input, self.inplace)
        return relu_bits(input, self.inplace)


class MemsaveLeakyReLU(nn.LeakyReLU):
    """:class:`torch.nn.LeakyReLU` whose backward keeps a bit mask (:func:`leaky_relu_bits`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if gated_off(self):  # Note [fully trainable]
            return F.leaky_relu(input, self.negative_slope, self.inplace)
        return leaky_relu_bits(input, self.negative_slope, self.inplace)


class MemsaveDropout(nn.Dropout):
    """:class:`torch.nn.Dropout` whose backward keeps its mask as bits (:func:`dropout_bits`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if gated_off(self):  # Note [fully trainable]
            return F.dropout(input, self.p, self.training, self.inplace)
        return dropout_bits(input, self.p, self.training, self.inplace)
