"""What every part of ``python -m scripts.codec_error`` shares: the constants, determinism, the
relative error of a set of gradients, and fresh copies of an op's inputs."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests._support.corpus_run import map_tensors

ROOT = Path(__file__).resolve().parents[2]
SEED = 0
LOSSY_DEFAULT = ("none", "int8", "fp8-e4m3", "fp8-e5m2", "int4", "int2")
# The ops that allowlist.py leaves out on purpose (its docstring), matched against op_db names.
DENIED = (
    "max",
    "amax",
    "clamp",
    "nn.functional.relu",
    "nn.functional.threshold",
    "div",
    "log",
    "sqrt",
    "pow",
    "reciprocal",
    "nn.functional.dropout",
    "log_softmax",
    "nn.functional.cross_entropy",
)
QUICK_OPS = (
    "mul",
    "div.no_rounding_mode",
    "log",
    "nn.functional.linear",
    "softmax",
    "nn.functional.layer_norm",
    "nn.functional.gelu",
    "tanh",
    "sigmoid",
    "nn.functional.scaled_dot_product_attention",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def seed_rng() -> None:
    torch.default_generator.manual_seed(SEED)


# -- errors -----------------------------------------------------------------------------------


@dataclass
class Error:
    """Relative error of a set of gradients against the reference (see the module docstring)."""

    rel_l2: float = 0.0
    max_rel: float = 0.0
    new_nonfinite: int = 0

    def worst(self, other: Error) -> Error:
        return Error(
            max(self.rel_l2, other.rel_l2),
            max(self.max_rel, other.max_rel),
            self.new_nonfinite + other.new_nonfinite,
        )


def _plain(t: torch.Tensor) -> torch.Tensor:
    if t.layout is not torch.strided:
        t = t.to_dense()
    t = t.detach().resolve_conj().resolve_neg()
    return torch.view_as_real(t) if t.is_complex() else t


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    parts = [_plain(t).reshape(-1).to(torch.float64) for t in ts]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def error_of(ref: Sequence[torch.Tensor | None], got: Sequence[torch.Tensor | None]) -> Error:
    """The error of ``got`` against ``ref``, gradient by gradient (None pairs skipped)."""
    if len(ref) != len(got):
        raise ValueError(f"{len(ref)} gradients vs {len(got)}")
    rs, gs = [], []
    for r, g in zip(ref, got, strict=True):
        if (r is None) != (g is None):
            raise ValueError("a gradient is None in one run only")
        if r is not None and g is not None:
            if r.shape != g.shape:
                raise ValueError(f"gradient shapes {list(r.shape)} vs {list(g.shape)}")
            rs.append(r)
            gs.append(g)
    r, g = _flat(rs), _flat(gs)
    finite = torch.isfinite(r)
    new_bad = int((finite & ~torch.isfinite(g)).sum())
    if new_bad:
        return Error(math.inf, math.inf, new_bad)
    r, g = r[finite], g[finite]
    if r.numel() == 0:
        return Error()
    d = g - r
    return Error(
        _ratio(float(d.norm()), float(r.norm())),
        _ratio(float(d.abs().max()), float(r.abs().max())),
    )


def identical(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> bool:
    """Bit-identical tensors (a NaN equals any NaN), None where the other is None."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                return False
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        x, y = _plain(x), _plain(y)
        # -0.0 == +0.0 here: the codecs never touch a forward output anyway
        same = (x == y) | (x.isnan() & y.isnan()) if x.is_floating_point() else x == y
        if not bool(same.all()):
            return False
    return True


# -- the op corpus ----------------------------------------------------------------------------


def _copy_layout(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in a new storage with the same size, stride, offset (and overlap)."""
    if x.layout is not torch.strided or x.is_conj() or x.is_neg():
        return x.detach().clone()
    storage = x.detach().untyped_storage().clone()
    return x.new_empty(0).set_(storage, x.storage_offset(), x.size(), x.stride())


class _Fresh(torch.autograd.Function):
    """Identity whose output is a non-leaf copy of its input: an activation, as in tests/_support/corpus.py
    (an in-place variant in a sample may then change it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _copy_layout(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def fresh_inputs(*objs: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """Fresh copies of ``objs`` (one per distinct tensor) and the leaves to differentiate."""
    memo: dict[int, torch.Tensor] = {}
    leaves: list[torch.Tensor] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            if t.requires_grad:
                leaves.append(t)
                memo[id(t)] = _Fresh.apply(t)
            else:
                memo[id(t)] = _copy_layout(t)
        return memo[id(t)]

    return [map_tensors(o, copy) for o in objs], leaves


def cotangent(t: torch.Tensor, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + 1000 + index)
    return torch.randn(t.shape, generator=gen, dtype=t.dtype)
