"""``offloadd demo``: train the built-in GPT with keep and with ssd offload, and compare."""

from __future__ import annotations

import argparse
import sys

import torch

from offloadd.runtime.stats import format_bytes
from offloadd.tools.train import RunSpec, add_model_arguments, model_kwargs, run_in_subprocess

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def main(ns: argparse.Namespace) -> int:
    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        common = model_kwargs(ns)
    except ValueError as e:
        print(f"offloadd demo: {e}", file=sys.stderr)
        return 2
    print(
        f"offloadd demo: GPT {ns.layers} layers, d={ns.d_model}, seq {ns.seq}, batch {ns.batch}, "
        f"{ns.steps} steps + 1 warm-up on {device}; each run in its own process",
        flush=True,
    )
    results = {}
    for strategy in ("keep", "ssd"):
        spec = RunSpec(strategy=strategy, device=device, **common)
        results[strategy] = run_in_subprocess(spec, progress=True)
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
    from offloadd.runtime.stats import Stats

    return Stats(**stats).summary()  # type: ignore[arg-type]
