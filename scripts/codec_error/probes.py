"""Probes: allowed ops on inputs that are hard for per-group ranges (a large common offset, one
outlier channel, peaky softmax)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offloadd import Offloader

from .common import SEED, cotangent, error_of, log, seed_rng


def _probe_cases(quick: bool) -> list[tuple[str, Callable[[], tuple[Any, list[torch.Tensor]]]]]:
    b, t, d = (2, 32, 256) if quick else (4, 128, 256)

    def ln(x: torch.Tensor) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            m = nn.LayerNorm(d)
            with torch.no_grad():
                m.weight.normal_(1.0, 0.1)
                m.bias.normal_(0.0, 0.1)
            xx = x.clone().requires_grad_()
            return (lambda: m(xx)), [xx, m.weight, m.bias]

        return f

    def lin(x: torch.Tensor) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            m = nn.Linear(d, d)
            xx = x.clone().requires_grad_()
            return (lambda: m(xx)), [xx, m.weight, m.bias]

        return f

    def softmax(scale: float) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            xx = (torch.randn(b, 4, t, t) * scale).requires_grad_()
            return (lambda: torch.softmax(xx, -1)), [xx]

        return f

    def sdpa(scale: float) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            q, k, v = (torch.randn(b, 4, t, 64) for _ in range(3))
            q, k = q * scale, k * scale
            q, k, v = (z.requires_grad_() for z in (q, k, v))
            return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), [q, k, v]

        return f

    def eager(scale: float) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            q, k, v = (torch.randn(b, 4, t, 64) for _ in range(3))
            q, k = q * scale, k * scale
            q, k, v = (z.requires_grad_() for z in (q, k, v))
            causal = torch.ones(t, t, dtype=torch.bool).triu(1)

            def attend() -> torch.Tensor:
                s = torch.matmul(q, k.transpose(-2, -1)) / 8.0
                p = torch.softmax(s.masked_fill(causal, -math.inf), -1)
                return torch.matmul(p, v)

            return attend, [q, k, v]

        return f

    g = torch.Generator().manual_seed(SEED)
    plain = torch.randn(b, t, d, generator=g)
    offset = plain + 50.0
    outlier = plain.clone()
    outlier[..., 7] *= 60.0  # one channel 60x the others, as in trained transformers
    return [
        ("layer_norm, N(0,1) input", ln(plain)),
        ("layer_norm, N(0,1) + 5 (common offset)", ln(plain + 5.0)),
        ("layer_norm, N(0,1) + 50 (common offset)", ln(offset)),
        ("layer_norm, one channel x60 (outlier)", ln(outlier)),
        ("linear, N(0,1) input", lin(plain)),
        ("linear, one channel x60 (outlier)", lin(outlier)),
        ("softmax, logits N(0,1)", softmax(1.0)),
        ("softmax, logits N(0,10^2) (peaky)", softmax(10.0)),
        ("sdpa causal, q,k,v N(0,1), head dim 64", sdpa(1.0)),
        ("sdpa causal, q,k x3 (logits std 9)", sdpa(3.0)),
        ("eager attention (matmul, softmax, matmul), q,k,v N(0,1)", eager(1.0)),
        ("eager attention, q,k x3 (logits std 9)", eager(3.0)),
    ]


def probes(codecs: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    out = []
    for label, make in _probe_cases(quick):
        fn, wrt = make()
        seed_rng()
        y = fn()
        cot = cotangent(y, 0)
        ref = torch.autograd.grad(y, wrt, cot)
        row: dict[str, Any] = {"probe": label, "codecs": {}}
        for codec in codecs:
            off = Offloader(tier="keep", codec={"name": codec})
            with off:
                y = fn()
            grads = torch.autograd.grad(y, wrt, cot)
            st = off.stats()
            off.close()
            err = error_of(ref, grads)
            row["codecs"][codec] = {**asdict(err), "coded_tensors": st.coded_tensors}
        out.append(row)
        log(
            f"[probes] {label}: "
            + ", ".join(f"{c} {v['rel_l2']:.2e}" for c, v in row["codecs"].items())
        )
    return out


# -- models -----------------------------------------------------------------------------------
