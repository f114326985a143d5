"""The models of the seams grid and their inputs.

``Net``: an input layer, a ``ModuleList`` of residual blocks (relay's groups, the planner's
blocks, what per-block compile and checkpointing wrap), a head. Each block's first Linear is
frozen (relay has weights to relay, memsave a frozen layer to skip), and a ReLU and a Dropout give
memsave and the RNG something to do. Every activation of a block is at least 16 KiB, above the
grid's ``min_bytes``. ``_gpt2``: a small Hugging Face GPT-2 for ``gradient_checkpointing_enable``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["Net", "batch", "build", "loss_of"]

B, D, IN, OUT, BLOCKS = 32, 160, 16, 8, 3
VOCAB, SEQ = 256, 32
_aten = torch.ops.aten


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (_aten.mm.default, _aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _sac_contexts() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(4 * d, d)
        self.up.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(self.act(self.up(self.norm(x)))))


class Net(nn.Module):
    """``ckpt``: how each block is checkpointed (``""``: not; ``"non-reentrant"``,
    ``"reentrant"``, ``"sac"``: selective, matmuls saved)."""

    def __init__(self, ckpt: str = "", d: int = D) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.inp = nn.Linear(IN, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(BLOCKS))
        self.head = nn.Linear(d, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            if not self.ckpt:
                h = layer(h)
            elif self.ckpt == "sac":
                h = checkpoint(layer, h, use_reentrant=False, context_fn=_sac_contexts)
            else:
                h = checkpoint(layer, h, use_reentrant=self.ckpt == "reentrant")
        return self.head(torch.tanh(h) * 2)


def _gpt2() -> nn.Module:
    """A small HF GPT-2 (its dropouts give memsave something); the decoder layers' weights
    frozen, but for their layer norms (relay's groups; a trainable part per layer)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=128, n_layer=3, n_head=4, n_positions=SEQ, vocab_size=VOCAB)
    m = GPT2LMHeadModel(cfg)
    for layer in m.transformer.h:
        for name, p in layer.named_parameters():
            p.requires_grad_(name.startswith("ln_"))
    return m


def build(kind: str, ckpt: str, seed: int, d: int = D) -> nn.Module:
    """The model ``kind`` (``"net"`` of width ``d``, or ``"hf"``) from ``seed``."""
    torch.manual_seed(seed)
    return _gpt2() if kind == "hf" else Net(ckpt, d)


def batch(kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "hf":
        return torch.randint(0, VOCAB, (8, SEQ), generator=gen)
    return torch.randn(B, IN, generator=gen)


def loss_of(kind: str, model: Any, x: torch.Tensor) -> torch.Tensor:
    if kind == "hf":
        return model(input_ids=x, labels=x).loss  # type: ignore[no-any-return]
    return model(x).float().square().mean()  # type: ignore[no-any-return]
