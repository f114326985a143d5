"""``offloadd demo``: train the built-in GPT with keep, recompute and ssd offload, and compare.

Each strategy runs in its own process, so that its peak RSS is its own. The report is a table
(step time, offloadd's peak resident activations, peak memory above the model, bytes moved, I/O
wait), one sentence of what offloading bought against keep and recompute, and whether losses and
final weights are bit-identical to keep's. The exit status is 1 only when ssd's are not: the
built-in GPT's non-reentrant checkpointing is expected to be bit-identical too, and a mismatch of
recompute is reported, but it is not offloadd's to answer for.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

from offloadd.cli_dirs import ready_dir
from offloadd.runtime.stats import Stats, format_bytes
from offloadd.tools.train import (
    RunFailed,
    RunSpec,
    add_model_arguments,
    model_kwargs,
    run_in_subprocess,
)

__all__ = ["STRATEGIES", "add_arguments", "format_report", "main"]

STRATEGIES = ("keep", "recompute", "ssd")
"""The demo's runs, in the order they run and are shown."""

_TITLES = {"keep": "keep", "recompute": "recompute", "ssd": "ssd offload"}

Result = Mapping[str, Any]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def main(ns: argparse.Namespace) -> int:
    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        common = model_kwargs(ns)
        if ns.ssd_dir:  # before any run (Note [directories of the command line])
            ready_dir("--ssd-dir", ns.ssd_dir)
    except ValueError as e:
        print(f"offloadd demo: {e}", file=sys.stderr)
        return 2
    print(
        f"offloadd demo: GPT {ns.layers} layers, d={ns.d_model}, seq {ns.seq}, batch {ns.batch}, "
        f"{ns.steps} steps + 1 warm-up on {device}, with {', '.join(STRATEGIES)}; "
        "each run in its own process",
        flush=True,
    )
    results: dict[str, Result | None] = {}
    for strategy in STRATEGIES:
        spec = RunSpec(strategy=strategy, device=device, **common)
        try:
            results[strategy] = run_in_subprocess(spec, progress=True)
        except RunFailed as e:
            if strategy != "recompute":
                raise
            # recompute is the reference, not the subject: report it and go on without it
            print(f"offloadd demo: the recompute run failed (exit {e.returncode})", file=sys.stderr)
            results[strategy] = None
    report, ssd_identical = format_report(results, device=device)
    print()
    print(report)
    return 0 if ssd_identical else 1


def format_report(results: Mapping[str, Result | None], *, device: str) -> tuple[str, bool]:
    """The demo's report from each strategy's ``train.run`` result (None: the run failed), and
    whether ssd's losses and final weights are bit-identical to keep's."""
    keep, ssd = results["keep"], results["ssd"]
    if keep is None or ssd is None:
        raise ValueError("the keep and ssd results are required")
    mem_key = "peak_device_above_base" if device == "cuda" else "peak_rss_above_base"
    mem_label = "peak device memory above model" if device == "cuda" else "peak RSS above model"
    mem_short = "peak device memory" if device == "cuda" else "peak RSS"

    def stat(r: Result, key: str, fmt: str) -> str:
        if "stats" not in r:
            return "-"  # no hooks ran (recompute)
        v = r["stats"][key]
        return format_bytes(v) if fmt == "bytes" else f"{v:.3f} s"

    rows: list[tuple[str, str, str]] = [
        ("median step time", "step_time_s", "s"),
        ("peak saved activations held", "peak_resident_bytes", "bytes"),
        (mem_label, mem_key, "bytes"),
        ("bytes written", "bytes_written", "bytes"),
        ("bytes read back", "bytes_read", "bytes"),
        ("time waiting on I/O", "io_wait_s", "s"),
    ]
    shown = [s for s in STRATEGIES if s in results]
    lines = [f"{'':32s}" + "".join(f" {_TITLES[s]:>14s}" for s in shown)]
    for label, key, fmt in rows:
        cells = []
        for s in shown:
            r = results[s]
            if r is None:
                cells.append("failed")
            elif key in ("step_time_s", mem_key):
                cells.append(f"{r[key]:.3f} s" if fmt == "s" else format_bytes(r[key]))
            else:
                cells.append(stat(r, key, fmt))
        lines.append(f"{label:32s}" + "".join(f" {c:>14s}" for c in cells))
    lines.append(
        "(peak saved activations held: offloadd's own accounting; recompute runs no hooks)"
    )
    lines.append("")
    lines.append(_bought(results, mem_key, mem_short))
    st = ssd["stats"]
    held = _ratio(st["peak_resident_bytes"], keep["stats"]["peak_resident_bytes"])
    lines.append(
        f"ssd offload wrote {format_bytes(st['bytes_written'])} and read "
        f"{format_bytes(st['bytes_read'])} back over {len(ssd['losses'])} steps (warm-up "
        f"included); training waited {st['io_wait_s']:.3f} s on I/O in all."
    )
    lines.append(f"By offloadd's accounting, ssd held {held} of keep's saved activations at peak.")
    lines.append("")
    ssd_identical = _identical(keep, ssd)
    lines.append(
        "losses and final weights bit-identical to keep: ssd offload "
        + ("yes" if ssd_identical else "NO")
        + f" (sha256 {ssd['weights_sha256'][:16]})"
    )
    recompute = results.get("recompute")
    if recompute is not None:
        same = _identical(keep, recompute)
        lines.append(
            "losses and final weights bit-identical to keep: recompute "
            + ("yes" if same else "NO (reported only: recompute is not offloadd's)")
            + f" (sha256 {recompute['weights_sha256'][:16]})"
        )
    for s in shown:
        r = results[s]
        if r is not None and r.get("oom"):
            lines.append(f"{_TITLES[s]} ran out of memory: {r['error']}")
    lines.append("ssd offload: " + Stats(**st).summary())
    return "\n".join(lines), ssd_identical


def _bought(results: Mapping[str, Result | None], mem_key: str, mem_short: str) -> str:
    """One sentence: ssd's (and recompute's) memory and step time, each as a multiple of keep's."""
    keep, ssd = results["keep"], results["ssd"]
    assert keep is not None and ssd is not None

    def held(r: Result) -> tuple[str, str]:
        return _ratio(r[mem_key], keep[mem_key]), _ratio(r["step_time_s"], keep["step_time_s"])

    mem, step = held(ssd)
    text = f"ssd offload held {mem} of keep's {mem_short} at {step} its step time"
    recompute = results.get("recompute")
    if recompute is not None:
        mem, step = held(recompute)
        text += f"; recompute held {mem} at {step}"
    return text + "."


def _ratio(a: float, b: float) -> str:
    if not b or math.isnan(a) or math.isnan(b):
        return "n/a"
    return f"{a / b:.2f}x"


def _identical(a: Result, b: Result) -> bool:
    return bool(a["weights_sha256"] == b["weights_sha256"] and a["losses"] == b["losses"])
