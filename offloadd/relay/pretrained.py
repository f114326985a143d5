"""The way in of docs/relay.md in one call, for Hugging Face models: :func:`from_pretrained`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from offloadd.relay.loading import weights_on_meta
from offloadd.relay.placeholder import RelayError
from offloadd.relay.surface import relay

__all__ = ["from_pretrained"]


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    model_class: Any = None,
    train: Sequence[str] = (),
    dtype: Any = None,
    **relay_kwargs: Any,
) -> nn.Module:
    """A transformers model from a local ``save_pretrained`` directory, relayed from it: built on
    the meta device by ``model_class`` (default ``AutoModelForCausalLM``) from the directory's
    ``config.json``, every parameter frozen but those whose names start with one of ``train``
    (``["lm_head"]``), then ``relay(model, checkpoint=path, dtype=dtype, **relay_kwargs)``
    (Note [loading from a checkpoint] in loading.py). Adapters (PEFT) are added after it, as to
    any model; a name on the Hub must be downloaded first (``huggingface_hub.snapshot_download``):
    the checkpoint is read where it lies."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where = Path(path)
    if not (where / "config.json").is_file():
        raise RelayError(
            f"offloadd relay: {str(where)!r} is not a save_pretrained directory (no config.json); "
            "download a Hub model first (huggingface_hub.snapshot_download) and give its path"
        )
    cls: Any = model_class if model_class is not None else AutoModelForCausalLM
    config = AutoConfig.from_pretrained(where)
    with weights_on_meta():
        model: nn.Module = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    names = [n for n, _ in model.named_parameters()]
    unknown = [t for t in train if not any(n.startswith(t) for n in names)]
    if unknown:
        raise RelayError(
            f"offloadd relay: train: no parameter's name starts with {', '.join(map(repr, unknown))}"
            f" (the model's begin with {', '.join(sorted({n.split('.')[0] for n in names}))})"
        )
    for n, p in model.named_parameters():
        p.requires_grad_(any(n.startswith(t) for t in train))
    return relay(model, checkpoint=where, dtype=dtype, **relay_kwargs)
