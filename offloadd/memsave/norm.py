"""BatchNorm1d/2d/3d in eval mode that saves its input only when the weight's gradient needs it.

In eval mode (running statistics) plain PyTorch's ``NativeBatchNormBackward0`` saves the input,
the weight and the running statistics whatever requires grad; ``native_batch_norm_backward``
with ``training=False`` reads the input only for the weight's gradient (the input gradient is
``grad * weight * rsqrt(running_var + eps)``, the bias gradient a sum of ``grad``). Here the
input is saved only when the weight requires grad; otherwise backward passes a stand-in to the
same aten op with the same output mask: bitwise plain's gradients. A hand-written formula would
not be (7e-7 off in float32).

Note: [batch norm stand-in]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The CPU kernel picks its path by layout: a contiguous input and gradient take the fused per-channel
kernel, anything else a generic one, and in bfloat16 the two round differently. So the stand-in
must be contiguous like the input it replaces (only contiguous inputs take this path): the
gradient itself, made contiguous (a copy only when it is not), has the input's shape and dtype;
its values feed only the weight's gradient, which is not asked for. (The expanded placeholder of
Note [placeholder] took the generic path: bfloat16 input gradients were 1 ulp off.)

In train mode (batch statistics), and in eval mode without running statistics, the input
gradient needs the normalised input, so nothing can be left out: the module runs plain
PyTorch's forward.

Note: [LayerNorm and GroupNorm]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
They are left untouched. They always normalise with the statistics of the batch, so their input
gradient reads the normalised input (``native_layer_norm_backward`` and
``native_group_norm_backward`` take the input, mean and rstd whatever ``output_mask`` says), and
with a frozen affine PyTorch already saves nothing more than that (the weight and bias are
parameters, free). Saving the output instead and inverting the affine map would not give the
same bits. There is no bit-identical saving to make.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from offloadd.memsave.once_differentiable import once_differentiable

__all__ = [
    "MemsaveBatchNorm1d",
    "MemsaveBatchNorm2d",
    "MemsaveBatchNorm3d",
    "batch_norm_eval_selective",
]


_BATCH_NORM_BACKWARD = torch.ops.aten.native_batch_norm_backward.default


class _BatchNormEval(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor,
        running_var: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        out, save_mean, save_invstd = torch.native_batch_norm(
            x, weight, bias, running_mean, running_var, False, 0.0, eps
        )
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.mask = [need_x, bool(need_w), bool(need_b)]
        ctx.eps = eps
        ctx.x_meta = (x.shape, x.dtype, x.device)
        ctx.save_for_backward(
            x if need_w else None, weight, running_mean, running_var, save_mean, save_invstd
        )
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, running_mean, running_var, save_mean, save_invstd = ctx.saved_tensors
        if x is None:  # read for its layout only: Note [batch norm stand-in]
            x = grad.contiguous()
        gx, gw, gb = _BATCH_NORM_BACKWARD(
            grad,
            x,
            weight,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            False,
            ctx.eps,
            ctx.mask,
        )
        return gx, gw, gb, None, None, None


def batch_norm_eval_selective(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``F.batch_norm(x, running_mean, running_var, weight, bias, False, 0, eps)`` saving the input
    only when ``weight`` requires grad. ``x`` must be contiguous unless it is saved."""
    out: torch.Tensor = _BatchNormEval.apply(x, weight, bias, running_mean, running_var, eps)
    return out


class _MemsaveBatchNorm:
    """The forward shared by the three classes (mixed in before the nn class)."""

    def _memsave_forward(self, x: torch.Tensor) -> torch.Tensor:
        bn: Any = self
        base: Any = type(self).__mro__[2]
        if bn.training:  # batch statistics (BN tuning's case): checked first, it is all it takes
            out: torch.Tensor = base.forward(bn, x)
            return out
        weight: torch.Tensor | None = bn.weight
        bias: torch.Tensor | None = bn.bias
        no_stats = bn.running_mean is None or bn.running_var is None
        # A trainable weight needs the input: plain's forward then saves the same, for less.
        weight_grad = weight is not None and weight.requires_grad
        wants = torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad)
        )
        if no_stats or weight_grad or not wants or not x.is_contiguous():
            out = base.forward(bn, x)
            return out
        bn._check_input_dim(x)
        return batch_norm_eval_selective(x, weight, bias, bn.running_mean, bn.running_var, bn.eps)


class MemsaveBatchNorm1d(_MemsaveBatchNorm, nn.BatchNorm1d):
    """:class:`torch.nn.BatchNorm1d`; in eval mode it saves its input only for the weight's
    gradient."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._memsave_forward(input)


class MemsaveBatchNorm2d(_MemsaveBatchNorm, nn.BatchNorm2d):
    """:class:`torch.nn.BatchNorm2d`; in eval mode it saves its input only for the weight's
    gradient."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._memsave_forward(input)


class MemsaveBatchNorm3d(_MemsaveBatchNorm, nn.BatchNorm3d):
    """:class:`torch.nn.BatchNorm3d`; in eval mode it saves its input only for the weight's
    gradient."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._memsave_forward(input)
