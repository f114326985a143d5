"""The model and run options ``offloadd demo``, ``offloadd bench step`` and the scripts share,
and the ``RunSpec`` fields they give (train.py)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_model_arguments", "model_kwargs"]

_SIZE_ARGS = ("layers", "d_model", "heads", "seq", "batch", "steps")


def add_model_arguments(p: argparse.ArgumentParser, **defaults: int) -> None:
    """The model and run options shared by ``offloadd demo`` and ``offloadd bench step``."""
    d = {"layers": 6, "d_model": 384, "heads": 6, "seq": 256, "batch": 8, "steps": 8, **defaults}
    p.add_argument("--layers", type=int, default=d["layers"], help="transformer blocks")
    p.add_argument(  # rok's and wall's name; --d-model: the old one
        "--hidden", "--d-model", dest="d_model", type=int, default=d["d_model"], help="model width"
    )
    p.add_argument("--heads", type=int, default=d["heads"], help="attention heads")
    p.add_argument("--seq", type=int, default=d["seq"], help="sequence length")
    p.add_argument("--batch", type=int, default=d["batch"], help="batch size")
    p.add_argument("--steps", type=int, default=d["steps"], help="timed steps (the median)")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first (at least 3 for steady state)"
    )
    p.add_argument(
        "--ssd-dir",
        default=None,
        help="offload directory, created (mode 0700) if missing (default: per-user dir)",
    )


def model_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """RunSpec fields from ``add_model_arguments`` options; ValueError names a bad option."""
    for name in _SIZE_ARGS:
        if getattr(ns, name) <= 0:
            flag = "hidden" if name == "d_model" else name
            raise ValueError(f"--{flag} must be positive")
    if ns.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more, got {ns.warmup}")
    return {
        "num_layers": ns.layers,
        "d_model": ns.d_model,
        "num_heads": ns.heads,
        "seq_len": ns.seq,
        "batch_size": ns.batch,
        "steps": ns.steps,
        "warmup": ns.warmup,
        "ssd_dir": ns.ssd_dir,
    }
