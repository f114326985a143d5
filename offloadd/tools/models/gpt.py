"""A small GPT, built into the package so the demo and benchmarks need no downloads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from offloadd.tools.models.sac import sac_context

__all__ = ["GPT", "Block", "GPTConfig"]


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 4096
    """Tokens in the vocabulary."""
    seq_len: int = 256
    """Longest sequence (size of the position table)."""
    num_layers: int = 4
    """Transformer blocks."""
    d_model: int = 256
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads; must divide ``d_model``."""
    dropout: float = 0.1
    """Dropout on attention output, MLP output and embeddings."""
    recompute: bool = False
    """Layerwise full recomputation (non-reentrant ``torch.utils.checkpoint`` around each block)."""
    selective: bool = False
    """With ``recompute``: selective, the matmuls' and attention's outputs saved (sac.py)."""

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide d_model ({self.d_model})")

    def num_params(self) -> int:
        d, L = self.d_model, self.num_layers
        return self.vocab_size * d + self.seq_len * d + L * (12 * d * d + 13 * d) + 2 * d


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then a GELU MLP, each residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        h = self.num_heads
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self._selective: dict[str, Any] = {"context_fn": sac_context} if cfg.selective else {}
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(
                    p, std=0.02 / (math.sqrt(2 * cfg.num_layers) if "out" in name else 1)
                )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when ``targets`` is given."""
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            if self.cfg.recompute and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False, **self._selective)
            else:
                x = block(x)
        logits = F.linear(self.ln(x), self.tok.weight)  # tied LM head
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
