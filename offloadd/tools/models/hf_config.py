"""Any causal language model transformers builds from a config: ``--hf-config DIR``, where DIR
holds a ``config.json`` as ``save_pretrained`` writes it (GPT-2, Llama, Mistral, Qwen2, Mixtral,
...), built with random weights (nothing is downloaded; no weights are read).

Errors name what is wrong: the path, the key, the value, and what this transformers knows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from offloadd.tools.models.hf import checkpoint_layers, require_transformers

__all__ = ["HFConfigError", "build_causal_lm", "check_seq", "load_config", "shape_of"]

_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_POSITIONS = ("max_position_embeddings", "n_positions")


class HFConfigError(ValueError):
    """A config directory that cannot be built (the message names the option, path and key)."""


def load_config(directory: str) -> Any:
    """The transformers config in ``directory``/config.json."""
    path = Path(directory).expanduser() / "config.json"
    if not path.is_file():
        raise HFConfigError(f"--hf-config: {path} not found (a directory save_pretrained wrote)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFConfigError(f"--hf-config: {path} is not readable JSON: {e}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise HFConfigError(f"--hf-config: {path} has no 'model_type' key")
    tf = require_transformers()
    try:
        return tf.AutoConfig.from_pretrained(str(path.parent))
    except (ValueError, KeyError) as e:
        raise HFConfigError(
            f"--hf-config: model_type {raw['model_type']!r} in {path} is not an architecture "
            f"transformers {tf.__version__} knows ({e})"
        ) from None


def shape_of(config: Any) -> dict[str, int]:
    """layers, hidden, vocab and positions (0: unbounded) of a config, by their usual keys."""

    def first(keys: tuple[str, ...], what: str) -> int:
        for k in keys:
            v = getattr(config, k, None)
            if isinstance(v, int):
                return v
        if what == "positions":
            return 0
        raise HFConfigError(f"--hf-config: the config has none of the keys {', '.join(keys)}")

    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise HFConfigError(f"--hf-config: the config's 'vocab_size' is {vocab!r}")
    return {
        "layers": first(_LAYERS, "layers"),
        "hidden": first(_HIDDEN, "hidden"),
        "vocab": vocab,
        "positions": first(_POSITIONS, "positions"),
    }


def check_seq(config: Any, seq_len: int) -> None:
    """HFConfigError if the config's positions (0: unbounded) are fewer than ``seq_len``."""
    positions = shape_of(config)["positions"]
    if positions and seq_len > positions:
        raise HFConfigError(
            f"--seq {seq_len} is longer than the config's max_position_embeddings ({positions})"
        )


def build_causal_lm(config: Any, *, seq_len: int, recompute: bool, selective: bool) -> nn.Module:
    """A causal LM of ``config`` with random weights, in training mode; ``recompute``
    (``selective``) as :func:`offloadd.tools.models.hf.build_hf`."""
    tf = require_transformers()
    check_seq(config, seq_len)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    try:
        model: nn.Module = tf.AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise HFConfigError(
            f"--hf-config: model_type {config.model_type!r} has no causal-LM model in "
            f"transformers {tf.__version__} ({str(e).splitlines()[0]})"
        ) from None
    model.train()
    if recompute:
        checkpoint_layers(model, selective)
    return model
