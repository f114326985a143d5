"""``offloadd demo``: train the built-in GPT with keep and with ssd offload, and compare."""

from __future__ import annotations

import argparse
import sys

import torch

from offloadd.stats import format_bytes
from offloadd.train import RunSpec, run_in_subprocess

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--d-model", type=int, default=384, help="model width (default 384)")
    p.add_argument("--heads", type=int, default=6, help="attention heads (default 6)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--steps", type=int, default=4, help="timed steps after a warm-up (default 4)")
    p.add_argument("--ssd-dir", default=None, help="offload directory (default: per-user dir)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def main(ns: argparse.Namespace) -> int:
    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ("layers", "d_model", "heads", "seq", "batch", "steps"):
        if getattr(ns, name) <= 0:
            print(f"offloadd demo: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    common = dict(
        num_layers=ns.layers,
        d_model=ns.d_model,
        num_heads=ns.heads,
        seq_len=ns.seq,
        batch_size=ns.batch,
        steps=ns.steps,
        device=device,
        ssd_dir=ns.ssd_dir,
    )
    print(
        f"offloadd demo: GPT {ns.layers} layers, d={ns.d_model}, seq {ns.seq}, batch {ns.batch}, "
        f"{ns.steps} steps + 1 warm-up on {device}; each run in its own process",
        flush=True,
    )
    results = {}
    for strategy in ("keep", "ssd"):
        results[strategy] = run_in_subprocess(RunSpec(strategy=strategy, **common), progress=True)
    keep, ssd = results["keep"], results["ssd"]
    mem_key = "peak_device_above_base" if device == "cuda" else "peak_rss_above_base"
    mem_label = "peak device memory" if device == "cuda" else "peak RSS above model"
    rows = [
        (
            "median step time",
            f"{keep['step_time_s']:.3f} s",
            f"{ssd['step_time_s']:.3f} s",
            f"{ssd['step_time_s'] / keep['step_time_s']:.3f}x",
        ),
        (
            "peak saved activations held",
            format_bytes(keep["stats"]["peak_resident_bytes"]),
            format_bytes(ssd["stats"]["peak_resident_bytes"]),
            f"{ssd['stats']['peak_resident_bytes'] / max(1, keep['stats']['peak_resident_bytes']):.3f}x",
        ),
        (
            mem_label,
            format_bytes(keep[mem_key]),
            format_bytes(ssd[mem_key]),
            f"{ssd[mem_key] / max(1, keep[mem_key]):.3f}x",
        ),
        (
            "bytes written",
            format_bytes(keep["stats"]["bytes_written"]),
            format_bytes(ssd["stats"]["bytes_written"]),
            "",
        ),
        (
            "bytes read back",
            format_bytes(keep["stats"]["bytes_read"]),
            format_bytes(ssd["stats"]["bytes_read"]),
            "",
        ),
        (
            "time waiting on I/O",
            f"{keep['stats']['io_wait_s']:.3f} s",
            f"{ssd['stats']['io_wait_s']:.3f} s",
            "",
        ),
    ]
    print()
    print(f"{'':30s} {'keep':>14s} {'ssd offload':>14s} {'ssd/keep':>10s}")
    for label, a, b, r in rows:
        print(f"{label:30s} {a:>14s} {b:>14s} {r:>10s}")
    same = keep["weights_sha256"] == ssd["weights_sha256"] and keep["losses"] == ssd["losses"]
    print()
    print(
        "losses and final weights bit-identical: " + ("yes" if same else "NO"),
        f"(sha256 {ssd['weights_sha256'][:16]})",
    )
    print("ssd offload:", _summary(ssd["stats"]))
    return 0 if same else 1


def _summary(stats: dict[str, object]) -> str:
    from offloadd.stats import Stats

    return Stats(**stats).summary()  # type: ignore[arg-type]
