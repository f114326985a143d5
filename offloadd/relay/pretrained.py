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
    ``config.json``, every parameter frozen but those named in ``train`` or inside a module it
    names (``["lm_head"]``; a tied weight trains under either name), then ``relay(model,
    checkpoint=path, dtype=dtype, **relay_kwargs)``, the model's
    ``_keys_to_ignore_on_load_unexpected`` ignored in the checkpoint
    (Note [loading from a checkpoint] in loading.py). Adapters (PEFT) are added after it, as to
    any model. ``path`` that is no local directory is a name on the Hub: its config and
    safetensors files are downloaded to the Hub's cache first (``snapshot_download``: to disk,
    never into memory), and read from there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where = Path(path)
    if not where.exists() and not where.is_absolute() and str(path).count("/") == 1:
        from huggingface_hub import snapshot_download

        where = Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
    if not (where / "config.json").is_file():
        raise RelayError(
            f"offloadd relay: {str(where)!r} is not a save_pretrained directory (no config.json) "
            "nor a name on the Hub (organisation/model)"
        )
    cls: Any = model_class if model_class is not None else AutoModelForCausalLM
    config = AutoConfig.from_pretrained(where)
    with weights_on_meta():
        model: nn.Module = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]  # a tied head too

    def trained(name: str) -> bool:
        return any(name == t or name.startswith(t + ".") for t in train)

    unknown = [t for t in train if not any(n == t or n.startswith(t + ".") for n in names)]
    if unknown:
        raise RelayError(
            f"offloadd relay: train: no parameter is {', '.join(map(repr, unknown))} or in it"
            f" (the model's names begin with {', '.join(sorted({n.split('.')[0] for n in names}))})"
        )
    model.requires_grad_(False)
    for n, p in model.named_parameters(remove_duplicate=False):
        if trained(n):
            p.requires_grad_(True)  # a tied weight trains if either of its names does
    ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    return relay(model, checkpoint=where, dtype=dtype, ignore_keys=ignore, **relay_kwargs)
