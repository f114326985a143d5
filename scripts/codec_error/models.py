"""Models: one training step's parameter gradients of small, randomly initialised HF models and
the built-in mini GPT, plain and under each codec."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from offloadd import Offloader

from .common import SEED, _flat, _ratio, error_of, identical, log, seed_rng


@dataclass
class Model:
    name: str
    what: str
    module: nn.Module
    loss: Callable[[], torch.Tensor]


def _hf_quiet() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def models(quick: bool) -> list[Model]:
    _hf_quiet()
    import transformers as tr

    tr.logging.set_verbosity_error()
    layers, seq, batch = (1, 32, 2) if quick else (2, 128, 4)
    vocab = 1024
    out: list[Model] = []
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)

    for attn in ("sdpa", "eager"):
        seed_rng()
        cfg = tr.GPT2Config(
            vocab_size=vocab,
            n_positions=seq,
            n_embd=256,
            n_layer=layers,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        gpt2 = tr.GPT2LMHeadModel._from_config(cfg, attn_implementation=attn).train()
        out.append(
            Model(
                f"GPT-2 ({attn} attention)",
                f"GPT2LMHeadModel, {layers} layers, n_embd 256, 4 heads, vocab {vocab}, "
                f"batch {batch} x seq {seq}, LM loss",
                gpt2,
                lambda m=gpt2: m(input_ids=ids, labels=ids).loss,
            )
        )

    seed_rng()
    bcfg = tr.BertConfig(
        vocab_size=vocab,
        hidden_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=seq,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    bert = tr.BertForMaskedLM(bcfg).train()
    out.append(
        Model(
            "BERT",
            f"BertForMaskedLM, {layers} layers, hidden 256, 4 heads, ffn 1024, vocab {vocab}, "
            f"batch {batch} x seq {seq}, MLM loss on every token",
            bert,
            lambda m=bert: m(input_ids=ids, labels=ids).loss,
        )
    )

    seed_rng()
    image, vbatch = (32, 2) if quick else (64, 8)
    vcfg = tr.ViTConfig(
        image_size=image,
        patch_size=8,
        hidden_size=192,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=768,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
    )
    vit = tr.ViTForImageClassification(vcfg).train()
    pixels = torch.randn(vbatch, 3, image, image, generator=g)
    labels = torch.randint(0, 10, (vbatch,), generator=g)
    out.append(
        Model(
            "ViT",
            f"ViTForImageClassification, {layers} layers, hidden 192, 4 heads, ffn 768, "
            f"{image}x{image} images, patch 8, batch {vbatch}, 10 classes",
            vit,
            lambda m=vit: m(pixel_values=pixels, labels=labels).loss,
        )
    )

    from offloadd.tools.models.gpt import GPT, GPTConfig

    seed_rng()
    mcfg = GPTConfig(
        vocab_size=vocab, seq_len=seq, num_layers=layers, d_model=256, num_heads=4, dropout=0.0
    )
    mini = GPT(mcfg).train()
    out.append(
        Model(
            "mini GPT (offloadd)",
            f"offloadd.tools.models.gpt, {layers} layers, d_model 256, 4 heads, vocab {vocab}, "
            f"batch {batch} x seq {seq}, dropout 0",
            mini,
            lambda m=mini: m(ids, ids),
        )
    )
    return out


def model_errors(codecs: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    rows = []
    for model in models(quick):
        params = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        wrt = [p for _, p in params]
        t0 = time.monotonic()
        loss = model.loss()
        ref = torch.autograd.grad(loss, wrt, allow_unused=True)
        loss2 = model.loss()
        again = torch.autograd.grad(loss2, wrt, allow_unused=True)
        row: dict[str, Any] = {
            "model": model.name,
            "what": model.what,
            "parameters": sum(p.numel() for p in wrt),
            "loss": loss.item(),
            "deterministic": identical([loss], [loss2]) and identical(ref, again),
            "codecs": {},
        }
        del loss, loss2, again
        # Parameters whose gradient is rounding noise (an attention key bias: softmax is invariant
        # to it, so its exact gradient is 0): a relative error of noise means nothing.
        rms_all = float(_flat([r for r in ref if r is not None]).pow(2).mean().sqrt())
        negligible = {
            n
            for (n, _), r in zip(params, ref, strict=True)
            if r is not None and float(_flat([r]).pow(2).mean().sqrt()) < 1e-4 * rms_all
        }
        row["negligible_grad_params"] = sorted(negligible)
        for codec in codecs:
            off = Offloader(tier="keep", codec={"name": codec})
            with off:
                loss = model.loss()
            st = off.stats()
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
            off.close()
            err = error_of(ref, grads)
            per_param = [
                (n, error_of([r], [g]))
                for (n, _), r, g in zip(params, ref, grads, strict=True)
                if r is not None and n not in negligible
            ]
            worst_name, worst = max(per_param, key=lambda x: x[1].rel_l2)
            row["codecs"][codec] = {
                **asdict(err),
                "loss_identical": loss.item() == row["loss"],
                "worst_param": worst_name,
                "worst_param_rel_l2": worst.rel_l2,
                "worst_param_max_rel": max(e.max_rel for _, e in per_param),
                "saved_bytes": st.saved_bytes,
                "peak_resident_bytes": st.peak_resident_bytes,
                "coded_tensors": st.coded_tensors,
                "coded_in_bytes": st.coded_in_bytes,
                "coded_out_bytes": st.coded_out_bytes,
            }
            del loss, grads
        base = row["codecs"].get("none")
        for v in row["codecs"].values():
            v["saved_ratio"] = _ratio(v["saved_bytes"], base["saved_bytes"]) if base else None
            v["peak_ratio"] = (
                _ratio(v["peak_resident_bytes"], base["peak_resident_bytes"]) if base else None
            )
            v["coded_ratio"] = _ratio(v["coded_out_bytes"], v["coded_in_bytes"])
        rows.append(row)
        log(
            f"[models] {model.name} ({time.monotonic() - t0:.1f} s): "
            + ", ".join(f"{c} {v['rel_l2']:.2e}" for c, v in row["codecs"].items())
        )
    return rows


# -- the report -------------------------------------------------------------------------------
