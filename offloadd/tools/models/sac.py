"""Selective activation checkpointing (SAC), the peer ``offloadd wall`` runs as ``sac``: each
block checkpointed, the outputs of its matrix multiplications and attention saved, everything
else (norms, activations, dropout, views) recomputed in backward. The policy users reach for
first with ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (torchtitan's
"op" SAC saves a similar set): the expensive ops are not run twice, the cheap ones' outputs
are not held."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "sac_context"]

_aten = torch.ops.aten
SAVED_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)
"""The ops whose outputs are saved; every other op in a block is recomputed."""


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def sac_context() -> Any:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant)."""
    return create_selective_checkpoint_contexts(_policy)
