"""GPT-2, BERT and T5 from transformers configs, with random weights (nothing is downloaded).

transformers is an optional dependency (the ``hf`` extra); it is imported only when one of these
families is built.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["HF_FAMILIES", "HF_VOCAB", "build_hf", "checkpoint_layers", "require_transformers"]

HF_FAMILIES = ("gpt", "bert", "t5")

HF_VOCAB = {"gpt": 50257, "bert": 30522, "t5": 32128}
"""Each family's usual vocabulary size, used when none is given."""


def require_transformers() -> Any:
    """The transformers module, or ImportError saying which extra installs it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "the gpt, bert and t5 models need transformers: pip install 'offloadd[hf]'"
        ) from e
    transformers.logging.set_verbosity_error()
    return transformers


def build_hf(
    family: str,
    *,
    num_layers: int,
    d_model: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int,
    recompute: bool,
    selective: bool = False,
) -> nn.Module:
    """A randomly initialised model of ``family``, in training mode.

    ``recompute`` turns on transformers' layerwise activation checkpointing, non-reentrant, the
    same kind the built-in GPT uses; ``selective``: with the matmuls' outputs saved (sac.py)."""
    tf = require_transformers()
    if d_model % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
    model: nn.Module
    if family == "gpt":
        model = tf.GPT2LMHeadModel(
            tf.GPT2Config(
                n_layer=num_layers,
                n_embd=d_model,
                n_head=num_heads,
                n_positions=seq_len,
                vocab_size=vocab_size,
                bos_token_id=vocab_size - 1,
                eos_token_id=vocab_size - 1,
                use_cache=False,
            )
        )
    elif family == "bert":
        model = tf.BertForMaskedLM(
            tf.BertConfig(
                num_hidden_layers=num_layers,
                hidden_size=d_model,
                num_attention_heads=num_heads,
                intermediate_size=4 * d_model,
                max_position_embeddings=seq_len,
                vocab_size=vocab_size,
            )
        )
    elif family == "t5":
        # num_layers encoder blocks and as many decoder blocks.
        model = tf.T5ForConditionalGeneration(
            tf.T5Config(
                num_layers=num_layers,
                num_decoder_layers=num_layers,
                d_model=d_model,
                d_ff=4 * d_model,
                num_heads=num_heads,
                d_kv=d_model // num_heads,
                vocab_size=vocab_size,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
                use_cache=False,
            )
        )
    else:
        raise ValueError(f"model family must be one of {', '.join(HF_FAMILIES)}, got {family!r}")
    model.train()
    if recompute:
        checkpoint_layers(model, selective)
    return model


def checkpoint_layers(model: nn.Module, selective: bool) -> None:
    """transformers' layerwise activation checkpointing, non-reentrant (``selective``: the
    matmuls' and attention's outputs saved, sac.py)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        from offloadd.tools.models.sac import sac_context

        kwargs["context_fn"] = sac_context
    hf_model: Any = model
    if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.x
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
