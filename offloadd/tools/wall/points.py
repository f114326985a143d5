"""One point of ``offloadd wall``: a strategy at one size, trained in its own process inside a
memory cgroup of the limit, and the row of wall.csv it gives.

The limit is the cgroup's (swap off), so an out-of-memory is the kernel's: its OOM killer ends
the process, or an allocation fails inside it (``"oom"`` in the run's result). Either way the
point's status is ``oom``; any other failure is ``error``, with the last line of its stderr.
"""

from __future__ import annotations

import csv
import os
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offloadd.tools.harness.cgroup import memory_cgroup
from offloadd.tools.harness.train import (
    RunFailed,
    RunSpec,
    failure,
    plan_counts,
    run_in_subprocess,
)
from offloadd.units import format_bytes

__all__ = ["FIELDS", "STRATEGIES", "WallSpec", "measure", "point_line", "write_rows"]

STRATEGIES = {
    "plain": "none",
    "recompute": "recompute",
    "offload-ssd": "ssd",
    "offload-cpu": "cpu",
    "auto": "auto",
    "sac": "sac",
    "compile-budget": "compile-budget",
    "compile-offload": "compile-offload",
    "torchtune-offload": "torchtune-offload",
}
"""``--strategies`` names -> ``RunSpec.strategy``: plain (no hooks), recompute (every block
checkpointed), offload-ssd / offload-cpu (offloadd's tiers, every tensor above ``min_bytes``),
auto (offloadd's planner, its budget a share of what the limit leaves: ``CAP_SHARE``), and the
peers a user would reach for instead: sac (selective activation checkpointing, the matmuls'
outputs saved: models/sac.py) and compile-budget (the model compiled whole with torch.compile's
activation memory budget: ``COMPILE_MEMORY_BUDGET``; inductor's cache is the run's own, so the
first compiled point compiles cold and the later ones reuse it, as a second run would), and on a
GPU compile-offload (torch.compile's activation offloading) and torchtune-offload (torchtune's
``OffloadActivations``, where it installs): harness/peers.py."""

FIELDS = (
    "strategy",
    "batch_size",
    "seq_len",
    "status",  # ok, oom, infeasible (auto: no plan fits its budget), error
    "peak_bytes",  # the cgroup's peak: everything the process was charged, torch included (on
    # a GPU: the device's peak allocated bytes, the model included)
    "samples_per_s",  # batch over the median timed step
    "step_time_s",  # the median timed step, and the spread of the timed steps
    "step_time_min_s",
    "step_time_max_s",
    "predicted_peak_bytes",  # offloadd plan's prediction (empty: not predicted yet)
    # offload-ssd: the prediction with staging_bytes of writes held behind a slow disk
    "predicted_slow_disk_peak_bytes",
    "plan",  # auto: its blocks kept, offloaded, recomputed ("k2 o10 r0"), and its budget
    "error",
    "round",  # 0: the search's point; 1 and on: measured again (--rounds)
)


@dataclass(kw_only=True, slots=True)
class WallSpec:
    """The model, the limit and how each point runs."""

    model: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int | None
    batch: int  # the batch size while --grow seq
    limit: int
    steps: int
    warmup: int
    ssd_dir: str | None
    point_timeout: float | None
    hf_config: str | None = None  # a config directory's causal LM instead of model
    device: str = "cpu"  # cuda: the limit is the device's memory (a per-process fraction)
    dtype: str = "float32"
    host_limit: int = 0  # on a GPU, a memory cgroup of this many bytes too (0: none)
    allocator: str = "auto"  # RunSpec.allocator of every point (command.py: --allocator)


def measure(
    w: WallSpec, strategy: str, batch: int, seq: int, *, limited: bool = True
) -> dict[str, Any]:
    """Train ``strategy`` at ``batch`` x ``seq`` inside a fresh cgroup of ``w.limit`` (not
    ``limited``: outside any, its peak then its RSS's); its row, with the run's losses, weights'
    digest and offloadd's stats beside the CSV's columns."""
    spec = RunSpec(
        strategy=STRATEGIES[strategy],
        model=w.model,
        num_layers=w.layers,
        d_model=w.hidden,
        num_heads=w.heads,
        seq_len=seq,
        vocab_size=w.vocab,
        batch_size=batch,
        steps=w.steps,
        warmup=w.warmup,
        ssd_dir=w.ssd_dir,
        memory_cap_bytes=w.limit,
        hf_config=w.hf_config,
        device=w.device,
        dtype=w.dtype,
        allocator=w.allocator,
    )
    row: dict[str, Any] = {"strategy": strategy, "batch_size": batch, "seq_len": seq}
    on_gpu = w.device.startswith("cuda")
    if not limited or (on_gpu and not w.host_limit):  # a GPU's limit is in the run itself
        try:
            res = run_in_subprocess(spec, timeout=w.point_timeout)
        except subprocess.TimeoutExpired:
            return {**row, "status": "error", "error": f"timed out after {w.point_timeout} s"}
        except RunFailed as e:
            return {**row, **failure(e)}
        return _row(row, res, res["peak_device"] if on_gpu else res["peak_rss"])
    with memory_cgroup(w.host_limit if on_gpu else w.limit, prefix="offloadd-wall") as cg:
        try:
            res = run_in_subprocess(spec, timeout=w.point_timeout, preexec_fn=cg.enter)
        except subprocess.TimeoutExpired:
            return {**row, "status": "error", "error": f"timed out after {w.point_timeout} s"}
        except RunFailed as e:
            return {**row, **failure(e, oom_killed=cg.oom_killed()), "peak_bytes": cg.peak()}
        peak = cg.peak()
    return _row(row, res, res["peak_device"] if on_gpu else peak)


def _row(row: dict[str, Any], res: dict[str, Any], peak: int) -> dict[str, Any]:
    row = {**row, "peak_bytes": peak}
    if res["oom"]:
        return {**row, "status": "oom", "error": res.get("error")}
    times = res["step_times_s"]
    step = res["step_time_s"]
    plan = res.get("plan")
    if plan is not None:
        row["plan"] = f"{plan_counts(plan)} in {format_bytes(plan['budget_bytes'])}"
    return {
        **row,
        "status": "ok",
        "samples_per_s": row["batch_size"] / step,
        "step_time_s": step,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "losses": res["losses"],
        "weights_sha256": res["weights_sha256"],
        "stats": res.get("stats"),
    }


def point_line(r: dict[str, Any], grow: str) -> str:
    """One line for a measured point, as the search goes."""
    size = r["batch_size"] if grow == "batch" else r["seq_len"]
    head = f"{r['strategy']:>12} {grow} {size:>5}: "
    peak = f"peak {format_bytes(r['peak_bytes'])}" if r.get("peak_bytes") is not None else ""
    if peak and r.get("predicted_peak_bytes") and r["peak_bytes"]:
        off = r["predicted_peak_bytes"] / r["peak_bytes"] - 1
        slow = r.get("predicted_slow_disk_peak_bytes")
        slow_text = f"; {format_bytes(slow)} behind a slow disk" if slow else ""
        peak += f" (predicted {format_bytes(r['predicted_peak_bytes'])}, {off:+.1%}{slow_text})"
    if r["status"] != "ok":
        return head + f"{r['status'].upper()}" + (f", {peak}" if peak else "") + f" ({r['error']})"
    return head + (
        f"ok, {r['samples_per_s']:.2f} samples/s (steps {r['step_time_min_s']:.2f}-"
        f"{r['step_time_max_s']:.2f} s), {peak}" + (f", plan {r['plan']}" if r.get("plan") else "")
    )


def write_rows(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Replace wall.csv with ``rows`` at once (a reader never sees half a file)."""
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(FIELDS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    os.replace(tmp, path)
