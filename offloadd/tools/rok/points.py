"""The points of ``offloadd rok``: measuring one, the row it gives, and rok.csv, which holds them.

One point is one (strategy, batch size, round) of a :class:`~offloadd.tools.rok.sweep.Sweep`,
trained in its own process by ``offloadd.tools.harness.train``. A point that runs out of memory gives a
row with status ``oom``; one that fails otherwise or times out, status ``error``.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offloadd.config import parse_size
from offloadd.tools.harness.train import (
    RunFailed,
    RunSpec,
    failure,
    plan_counts,
    run_in_subprocess,
    split_label,
)
from offloadd.tools.rok.sweep import AUTO, RECOMPUTE_BUDGET, Sweep, run_strategy
from offloadd.units import format_bytes

__all__ = [
    "ADDED",
    "FIELDS",
    "RETRY_MARGIN",
    "auto_budget",
    "measure",
    "point_line",
    "read_points",
    "write_points",
]

FIELDS: dict[str, Callable[[str], Any]] = {
    "model": str,
    "layers": int,
    "hidden": int,
    "heads": int,
    "seq": int,
    "vocab": int,
    "device": str,
    "steps": int,
    "warmup": int,
    "codec": str,  # offloadd's codec for the strategies with hooks (none: exact)
    "compile": lambda text: text == "True",  # the model compiled whole (rok --compile)
    "strategy": str,
    "batch_size": int,
    "round": int,  # 1..--repeats
    "status": str,  # ok, oom, infeasible (auto: no plan fits its budget) or error
    "step_time_s": float,  # median of the timed steps
    "step_time_min_s": float,
    "step_time_max_s": float,  # with the min: the timed steps' spread (tools/harness/spread.py)
    "samples_per_s": float,
    "tokens_per_s": float,
    "model_tflops": float,  # model FLOPs (6·N·tokens + attention) per second, recompute not counted
    "activation_peak_bytes": int,  # CUDA: device peak above the built model; CPU: peak RSS above it
    "peak_rss_above_base": int,
    "peak_device_above_base": int,
    "peak_live_above_base": int,  # CPU, offloadd's host cache: its peak live bytes above base
    "peak_resident_bytes": int,  # offloadd's own accounting (strategies with hooks)
    "saved_bytes": int,
    "offloaded_bytes": int,  # of saved_bytes, those the hooks moved off (written, or taken back
    # from staging before their write: a tiny model's backward can come first)
    "bytes_written": int,
    "bytes_read": int,
    "io_wait_s": float,
    "steal_s": float,  # CPU time the hypervisor took per timed step, all CPUs (median; Linux)
    "params": int,
    "flops_per_step": int,
    "weights_sha256": str,
    "budget_bytes": int,  # auto: its budget on the memory axis (see [budgets on the axis])
    "held_budget_bytes": int,  # auto: the budget offloadd planned for (saved activations held)
    "plan": str,  # auto: blocks kept, offloaded, recomputed ("k2 o10 r0")
    "race": str,  # auto: its race's paired ratio, 95 % interval, blocks (see [race] in auto/race.py)
    "error": str,
}
"""The columns of rok.csv and their types (an empty cell reads back as None)."""


ADDED: dict[str, Any] = {
    "codec": "none",
    "compile": False,
    "race": None,
    "offloaded_bytes": None,
    "step_time_max_s": None,
}
"""Columns later versions added, with what older sweeps ran: exact, eager, no race or spread
shown."""


def _parse(name: str, text: str) -> Any:
    if text == "":
        return None
    return FIELDS[name](text)


def read_points(path: Path) -> list[dict[str, Any]]:
    """The typed rows of a rok.csv; ValueError if its columns are not this version's."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        names = list(reader.fieldnames or ())
        # sweeps from before a later column (the race, --compile, --codec, offloaded bytes)
        # read back with it as such sweeps ran
        if names != [k for k in FIELDS if k in names] or not set(FIELDS) - set(names) <= set(ADDED):
            raise ValueError(f"{path} does not have the columns of this offloadd version")
        before = {k: v for k, v in ADDED.items() if k not in names}
        return [before | {k: _parse(k, v) for k, v in row.items()} for row in reader]


def write_points(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace rok.csv with ``rows`` at once (a reader never sees half a file)."""
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(FIELDS))
        w.writeheader()
        for r in rows:
            w.writerow(r)
    os.replace(tmp, path)


def measure(
    sw: Sweep, strategy: str, batch: int, n: int, done: list[dict[str, Any]]
) -> dict[str, Any]:
    """Train the point (``strategy``, ``batch``, round ``n``) in its own process; its row.
    ``done``: the rows measured so far (an ``auto@recompute`` point's budget is among them)."""
    row: dict[str, Any] = {**sw.key(), "strategy": strategy, "batch_size": batch, "round": n}
    budget = None
    if strategy.startswith(AUTO):
        axis, budget, why = auto_budget(strategy.removeprefix(AUTO), batch, n, done)
        if budget is None:  # no recompute point to take it from, or below any run's needs
            return {**row, "status": "error" if axis is None else "infeasible", "error": why}
        row["budget_bytes"] = axis
    spec = RunSpec(
        strategy=run_strategy(strategy),
        budget=budget,
        codec=split_label(strategy, sw.codec)[1],
        model=sw.model,
        num_layers=sw.layers,
        d_model=sw.hidden,
        num_heads=sw.heads,
        seq_len=sw.seq,
        vocab_size=sw.vocab,
        batch_size=batch,
        steps=sw.steps,
        warmup=sw.warmup,
        allocator=sw.allocator,
        device=sw.device,
        ssd_dir=sw.ssd_dir,
        memory_limit_bytes=sw.memory_limit,
        compile=sw.compile,
    )
    out = {**row, **_run(sw, spec)}
    axis = row.get("budget_bytes")
    if out["status"] == "ok" and axis is not None and out["activation_peak_bytes"] > axis:
        # Over its budget on the axis: once more, with offloadd's budget smaller by the excess
        # and a margin (see [budgets on the axis]).
        excess = out["activation_peak_bytes"] - axis
        held = int(out["held_budget_bytes"]) - excess - int(RETRY_MARGIN * axis)
        if held <= 0:
            return {**row, "status": "infeasible", "error": "over its budget, and no room left"}
        spec.budget = str(held)
        again = {**row, **_run(sw, spec)}
        if again["status"] == "ok" and again.get("plan"):
            again["plan"] += " (2nd try)"
        return again
    return out


def _run(sw: Sweep, spec: RunSpec) -> dict[str, Any]:
    try:
        res = run_in_subprocess(spec, timeout=sw.point_timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timed out after {sw.point_timeout} s"}
    except RunFailed as e:
        return failure(e)
    return _results(res, spec.batch_size, cuda=sw.device == "cuda")


RETRY_MARGIN = 0.02
"""An auto point over its budget on the axis runs again with offloadd's budget smaller by the
excess and this fraction of the budget (see [budgets on the axis])."""


def auto_budget(
    token: str, batch: int, n: int, done: list[dict[str, Any]]
) -> tuple[int | None, str | None, str]:
    """An ``--budgets`` entry on the ROK plot's memory axis, and as offloadd's budget.

    Note: [budgets on the axis] rok's memory axis is the measured activation peak (CUDA: device
    memory allocated above the built model; CPU: RSS above it). offloadd's budget bounds the
    activation peak as the allocator counts it (see [measured peaks] in auto/probe.py): on CUDA
    the same quantity, so a budget ``B`` on the axis (``recompute``: recompute's measured peak at
    this batch size; ``0.3x``: that fraction of keep's; a size: itself) goes to offloadd as it
    is. On CPU the axis also holds what the host cache keeps mapped for reuse and whatever is
    not torch's (glibc's heap, offloadd's buffers mapped before the first step), so ``B`` becomes
    ``B - overhead``, the overhead being a measured point's RSS peak less the host cache's peak
    live bytes, at this batch size and from the same round when there is one: offload-ssd's,
    the same tier and host allocator as auto. Without it, the overhead is that point's RSS peak
    less the saved activations offloadd held (its own accounting), from offload-ssd's or keep's
    point; without either, a fraction goes to offloadd as it is (of its own estimate of keep's
    footprint) and a size too. What the host cache keeps mapped grows with what is live (up to a
    quarter of its peak), so a plan that keeps more can still land over ``B``: such a point runs
    once more with offloadd's budget smaller by the excess and ``RETRY_MARGIN`` of ``B`` (its plan
    then says "2nd try"); still over, it is shown so. The margin: a plan that fills its budget
    lands on ``B`` give or take what RSS moves between runs (a second try smaller by the excess
    alone still went over: the race's steps of a plan that keeps blocks count in the run's peak;
    docs/benchmarks/rok-race_mini-gpt_b1-b8_cpu-2core_2026-11-26.md). Returns (B or None,
    offloadd's budget or None, why not).
    """

    def latest(strategy: str) -> dict[str, Any] | None:
        ok = [
            r
            for r in done
            if r["strategy"] == strategy and r["batch_size"] == batch and r["status"] == "ok"
        ]
        same = [r for r in ok if r["round"] == n] or ok
        return same[-1] if same else None

    keep = latest("keep")
    overhead = None
    for ref in (latest("offload-ssd"), keep):
        if ref is None:
            continue
        if ref.get("peak_device_above_base") is not None:  # CUDA: the budget's own measure
            overhead = 0
        elif ref.get("peak_live_above_base") is not None:
            overhead = max(0, ref["activation_peak_bytes"] - ref["peak_live_above_base"])
        elif ref.get("peak_resident_bytes") is not None:
            overhead = max(0, ref["activation_peak_bytes"] - ref["peak_resident_bytes"])
        else:
            continue
        break
    if token == RECOMPUTE_BUDGET:
        rec = latest("recompute")
        if rec is None:
            return None, None, "no recompute point to take the budget of"
        axis = int(rec["activation_peak_bytes"])
    elif token.strip().lower().endswith("x"):
        if keep is None:
            return None, token, ""
        axis = int(float(token.strip()[:-1]) * keep["activation_peak_bytes"])
    else:
        axis = parse_size("--budgets", token)
    held = axis - (overhead or 0)
    if held <= 0:
        return (
            axis,
            None,
            (
                f"budget {format_bytes(axis)} is below the memory a run needs besides saved "
                f"activations ({format_bytes(overhead or 0)})"
            ),
        )
    return axis, str(held), ""


def _results(res: dict[str, Any], batch: int, *, cuda: bool) -> dict[str, Any]:
    """The columns of a run whose process exited cleanly: ok, or oom if it ran out of memory."""
    st = res.get("stats") or {}
    step = res["step_time_s"]
    ok = not res["oom"] and step is not None and math.isfinite(step) and step > 0
    out: dict[str, Any] = {
        "status": "ok" if ok else "oom",
        # an ok auto row whose plan changed during its timed steps says so (the race restarted
        # after a replan, or a re-profile): its time is partly a race's
        "error": res.get("error")
        or ("auto not settled in every timed step" if res.get("auto_settled") is False else None),
        "warmup": res.get("warmup_steps"),  # what ran: auto from train.AUTO_WARMUP, until settled
        "peak_rss_above_base": res["peak_rss_above_base"],
        "peak_device_above_base": res.get("peak_device_above_base"),
        "activation_peak_bytes": (
            res["peak_device_above_base"] if cuda else res["peak_rss_above_base"]
        ),
        "peak_live_above_base": res.get("peak_live_above_base"),
        "peak_resident_bytes": st.get("peak_resident_bytes"),
        "saved_bytes": st.get("saved_bytes"),
        "offloaded_bytes": st.get("offloaded_bytes"),
        "bytes_written": st.get("bytes_written"),
        "bytes_read": st.get("bytes_read"),
        "io_wait_s": st.get("io_wait_s"),
        "steal_s": res.get("steal_s"),
        "params": res["params"],
        "flops_per_step": res["flops_per_step"],
        "weights_sha256": res["weights_sha256"] if ok else None,
    }
    plan = res.get("plan")
    if plan is not None:
        out["held_budget_bytes"] = plan["budget_bytes"]
        out["plan"] = plan_counts(plan)
        out["race"] = plan.get("race")
    if ok:
        out.update(
            step_time_s=step,
            step_time_min_s=min(res["step_times_s"]),
            step_time_max_s=max(res["step_times_s"]),
            samples_per_s=batch / step,
            tokens_per_s=res["tokens_per_step"] / step,
            model_tflops=res["flops_per_step"] / step / 1e12,
        )
    return out


def point_line(r: dict[str, Any]) -> str:
    """One line for a measured point, as the sweep goes."""
    head = f"{r['strategy']:>12} batch {r['batch_size']:>4}" + (
        f" round {r['round']}: " if r.get("round", 1) > 1 else ": "
    )
    if r["status"] != "ok":
        return head + f"{r['status'].upper()} ({r['error']})"
    held = r["peak_resident_bytes"]
    spread = (
        f" (steps {r['step_time_min_s']:.3f}-{r['step_time_max_s']:.3f})"
        if r.get("step_time_max_s") is not None
        else ""
    )
    return head + (
        f"{r['step_time_s']:.3f} s/step{spread}, {r['samples_per_s']:.2f} samples/s, "
        f"{r['model_tflops'] * 1e3:.1f} GFLOP/s, activations {format_bytes(r['activation_peak_bytes'])}"
        + (f" (offloadd holds {format_bytes(held)})" if held is not None else "")
    )
