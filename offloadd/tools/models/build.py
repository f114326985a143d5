"""Build a trainable model by name, with what a measured run needs to know about it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offloadd.tools.models.gpt import GPT, GPTConfig
from offloadd.tools.models.hf import HF_FAMILIES, HF_VOCAB, build_hf
from offloadd.tools.models.hf_config import build_causal_lm, load_config, shape_of

__all__ = ["MODELS", "TrainModel", "build_model", "default_vocab"]

MODELS = ("mini-gpt", *HF_FAMILIES)
"""``mini-gpt`` is the built-in GPT; ``gpt``, ``bert`` and ``t5`` need transformers."""


@dataclass(kw_only=True)
class TrainModel:
    module: nn.Module
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(inputs, next tokens), both (batch, seq) token ids -> scalar loss."""
    num_params: int
    attention_layers: int
    """seq x seq attentions per token: blocks, plus the T5 decoder's cross-attentions."""
    d_model: int
    vocab_size: int
    """The token ids its loss takes are below this."""

    def flops_per_step(self, batch_size: int, seq_len: int) -> int:
        """Model FLOPs of one training step: 6·N per token for the weights, plus attention
        (QKᵀ and AV, 4·seq·d per token and layer forward, times 3 for forward and backward)."""
        tokens = batch_size * seq_len
        attention = 12 * self.attention_layers * self.d_model * seq_len
        return (6 * self.num_params + attention) * tokens


def _compiled(module: nn.Module, compile: bool | Callable[..., Any]) -> Any:
    """``module`` as a run calls it: itself, compiled whole by inductor (True), or by the backend
    ``compile`` names."""
    if compile is False:
        return module
    return torch.compile(module) if compile is True else torch.compile(module, backend=compile)


def default_vocab(name: str) -> int:
    return GPTConfig().vocab_size if name == "mini-gpt" else HF_VOCAB[name]


def build_model(
    name: str,
    *,
    num_layers: int,
    d_model: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int | None = None,
    recompute: bool = False,
    selective: bool = False,
    compile: bool | Callable[..., Any] = False,
    hf_config: str | None = None,
) -> TrainModel:
    """Build ``name`` (one of MODELS) with random weights from the current torch seed;
    ``recompute``: each block checkpointed (``selective``: its matmuls' outputs saved, sac.py);
    ``compile``: its loss runs ``torch.compile(module)``, the model compiled whole (given a
    callable: compiled by that backend, as the predictor traces a compiled run).
    ``hf_config``: instead, the causal LM of that config directory (hf_config.py; the sizes
    are the config's, ``seq_len`` the sequence trained)."""
    if hf_config is not None:
        return _from_config(hf_config, seq_len, recompute, selective, compile)
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    # The same shape for the built-in GPT and for the transformers families.
    shape: dict[str, Any] = {
        "num_layers": num_layers,
        "d_model": d_model,
        "num_heads": num_heads,
        "seq_len": seq_len,
        "vocab_size": vocab_size or default_vocab(name),
        "recompute": recompute,
        "selective": selective,
    }
    if name == "mini-gpt":
        cfg = GPTConfig(**shape)
        gpt = GPT(cfg)
        run: Any = _compiled(gpt, compile)
        return TrainModel(
            module=gpt,
            loss=lambda x, y: run(x, y),
            num_params=cfg.num_params(),
            attention_layers=num_layers,
            d_model=d_model,
            vocab_size=cfg.vocab_size,
        )
    module = build_hf(name, **shape)
    return _transformers_model(
        module,
        compile,
        shifts=name == "gpt",
        attention_layers=3 * num_layers if name == "t5" else num_layers,
        d_model=d_model,
        vocab_size=shape["vocab_size"],
    )


def _from_config(
    directory: str,
    seq_len: int,
    recompute: bool,
    selective: bool,
    compile: bool | Callable[..., Any],
) -> TrainModel:
    config = load_config(directory)
    shape = shape_of(config)
    module = build_causal_lm(config, seq_len=seq_len, recompute=recompute, selective=selective)
    return _transformers_model(
        module,
        compile,
        shifts=True,
        attention_layers=shape["layers"],
        d_model=shape["hidden"],
        vocab_size=shape["vocab"],
    )


def _transformers_model(
    module: nn.Module,
    compile: bool | Callable[..., Any],
    *,
    shifts: bool,
    attention_layers: int,
    d_model: int,
    vocab_size: int,
) -> TrainModel:
    """A transformers model as a TrainModel; ``shifts``: a causal LM, which takes the inputs as
    its labels and shifts them itself (BERT, every position masked-LM, and T5 take the next
    tokens as they are)."""
    runner: Any = _compiled(module, compile)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.contiguous(), y.contiguous()
        out: torch.Tensor = runner(input_ids=x, labels=x if shifts else y).loss
        return out

    return TrainModel(
        module=module,
        loss=loss,
        num_params=sum(p.numel() for p in module.parameters()),
        attention_layers=attention_layers,
        d_model=d_model,
        vocab_size=vocab_size,
    )
