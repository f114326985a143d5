"""The report of ``offloadd bench step``: a markdown page of medians, ratios and targets."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psutil
import torch

from offloadd.units import format_bytes

__all__ = ["PLAIN", "RATIOS", "TRACE_COLUMNS", "Ratio", "format_report", "per_round"]

Results = Mapping[str, Sequence[Mapping[str, Any]]]
"""Each strategy's ``train.run`` results, one per round, rounds in the same order."""

Ratio = tuple[str, str, str, str, str]
"""(label, numerator strategy, denominator strategy, result key, target)."""

PLAIN = "none:system"
"""Plain PyTorch on glibc's heap: the baseline a user compares against."""

RATIOS: tuple[Ratio, ...] = (
    ("ssd step time / keep (same allocator)", "ssd", "keep", "step_time_s", "<= 1.10"),
    ("ssd step time / recompute", "ssd", "recompute", "step_time_s", "< 1"),
    ("keep step time / plain", "keep", PLAIN, "step_time_s", "(allocator + hooks)"),
    ("ssd step time / plain", "ssd", PLAIN, "step_time_s", "-"),
    ("ssd peak RSS above model / plain", "ssd", PLAIN, "peak_rss_above_base", "<= 0.15"),
    ("ssd peak RSS above model / keep", "ssd", "keep", "peak_rss_above_base", "<= 0.35"),
    ("ssd peak RSS above model / recompute", "ssd", "recompute", "peak_rss_above_base", "<= 1.0"),
)
"""The ratios of steady offloading: its cost against keep on the same allocator, its memory
against plain PyTorch; and step time against recompute, the first target."""

TRACE_COLUMNS = (
    ("step", "step_s"),
    ("forward", "forward_s"),
    ("backward", "backward_s"),
    ("optimizer", "optimizer_s"),
    ("outside hooks", "compute_s"),
    ("in pack", "pack_s"),
    ("in unpack", "unpack_s"),
    ("read waits", "read_wait_s"),
    ("write waits", "write_wait_s"),
)
"""--trace's columns (seconds per step): medians of the timed steps, then over rounds."""

_MODEL_NAMES = {
    "mini-gpt": "built-in GPT",
    "gpt": "GPT-2 (transformers, random weights)",
    "bert": "BERT (transformers, random weights)",
    "t5": "T5 (transformers, random weights)",
}


def per_round(results: Results, num: str, den: str, key: str) -> list[float]:
    """``num``'s value of ``key`` over ``den``'s, round by round (rounds with a zero skipped)."""
    return [
        float(a[key]) / float(b[key])
        for a, b in zip(results[num], results[den], strict=True)
        if b[key]
    ]


def format_report(
    ns: argparse.Namespace,
    results: Results,
    *,
    command: str,
    hook_cost: Mapping[str, float] | None = None,
    depth: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
) -> str:
    """The whole report: how it was run, one row per strategy, the ratios, the extras."""
    cpu = platform.processor() or platform.machine()
    model = _MODEL_NAMES.get(ns.model, ns.model)
    lines = [
        "# Step benchmark: plain, keep, recompute and ssd offload, steady state (CPU)\n",
        f"- date: {time.strftime('%Y-%m-%d')}",
        f"- machine: {os.cpu_count()} cores ({cpu}), "
        f"{format_bytes(psutil.virtual_memory().total)} RAM, torch {torch.__version__}",
        f"- command: `{command}`",
        "- MALLOC_MMAP_THRESHOLD_: "
        + os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset (glibc default)"),
        f"- model: {model}, {ns.layers} layers, d={ns.d_model}, {ns.heads} heads, seq {ns.seq}, "
        f"batch {ns.batch}"
        f"{', compiled whole (torch.compile, inductor)' if getattr(ns, 'compile', False) else ''}"
        f"; {_count(ns.steps, 'timed step')} (their median) after "
        f"{_count(_warmups(results, ns), 'warm-up step')}, "
        f"{_count(ns.rounds, 'round')} interleaved, one process per run; medians over rounds",
        f"- allocator: {_allocators(results)}; `{PLAIN}` is plain PyTorch on glibc's heap\n",
        *_strategy_table(results),
        "",
        *_ratio_table(results),
        "",
        *(_trace_table(results) if getattr(ns, "trace", False) else []),
        *_codec_table(results),
        *_identity(results),
    ]
    if hook_cost is not None:
        lines.append(
            f"Hook cost per small kept tensor (pack + unpack, added over identity hooks): "
            f"{hook_cost['added_us']:.2f} µs (identity hooks {hook_cost['identity_us']:.2f} µs "
            f"per op, offloadd {hook_cost['offloadd_us']:.2f} µs); target <= 3 µs\n"
        )
    if depth is not None:
        a, b = (r["stats"] for r in depth)
        ra, rb = a["peak_resident_bytes"], b["peak_resident_bytes"]
        lines.append(
            f"Depth scaling (ssd): peak_resident_bytes {format_bytes(ra)} at {ns.layers} "
            f"layers, {format_bytes(rb)} at {ns.deep_layers} layers: ratio "
            f"{_fmt(rb / ra if ra else float('nan'))} (target <= 1.2); saved bytes "
            f"{format_bytes(a['saved_bytes'])} vs {format_bytes(b['saved_bytes'])}\n"
        )
    return "\n".join(lines)


def _strategy_table(results: Results) -> list[str]:
    lines = [
        "| strategy | step time (s) | drift | peak RSS above model | peak saved bytes held "
        "(offloadd accounting) | written | read | io wait (s) | CPU stolen per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s, runs in results.items():

        def med(key: str, runs: Sequence[Mapping[str, Any]] = runs) -> float:
            return statistics.median(float(r[key]) for r in runs)

        def stat(key: str, runs: Sequence[Mapping[str, Any]] = runs) -> str:
            if "stats" not in runs[0]:
                return "-"  # no hooks ran (recompute, none)
            v = statistics.median(float(r["stats"][key]) for r in runs)
            return f"{v:.3f}" if key == "io_wait_s" else format_bytes(v)

        # the hypervisor's steal, all CPUs (train._stolen_s): host-served I/O shows up there
        stolen = [float(r["steal_s"]) for r in runs if r.get("steal_s") is not None]
        steal = f"{statistics.median(stolen) * 1e3:.0f} ms" if stolen else "-"

        lines.append(
            f"| {s} | {med('step_time_s'):.3f} | {_drift(runs)} | "
            f"{format_bytes(med('peak_rss_above_base'))} | "
            f"{stat('peak_resident_bytes')} | {stat('bytes_written')} | {stat('bytes_read')} | "
            f"{stat('io_wait_s')} | {steal} |"
        )
    return lines


def _drift(runs: Sequence[Mapping[str, Any]]) -> str:
    """The timed steps' second half over their first half (medians, then over rounds): 1.00
    in steady state; far from it, more warm-up or more steps are needed."""
    ratios = []
    for r in runs:
        times = r.get("step_times_s") or []
        half = len(times) // 2
        if half:
            ratios.append(statistics.median(times[half:]) / statistics.median(times[:half]))
    return f"{statistics.median(ratios):.2f}" if ratios else "-"


def _warmups(results: Results, ns: argparse.Namespace) -> int:
    counts = [int(r.get("warmup_steps", ns.warmup)) for runs in results.values() for r in runs]
    return max(counts) if counts else int(ns.warmup)


def _allocators(results: Results) -> str:
    """Which allocator each strategy ran on."""
    named = {s: str(runs[0].get("allocator", "?")) for s, runs in results.items() if runs}
    return ", ".join(f"{s}: {a}" for s, a in named.items())


def _trace_table(results: Results) -> list[str]:
    """Where each strategy's step time goes (``--trace``), and how busy the CPUs were."""
    head = " | ".join(name for name, _ in TRACE_COLUMNS)
    lines = [
        "Where the step time goes (seconds per step; median of the timed steps, then over "
        "rounds). *outside hooks* is the step's time outside offloadd's pack and unpack hooks; "
        "the waits are part of the hooks' time; busy cores is this process's CPU time over the "
        "step's wall time; steal is CPU time the hypervisor took, all CPUs.\n",
        f"| strategy | {head} | busy cores | CPU idle | steal |",
        "|---|" + "---|" * (len(TRACE_COLUMNS) + 3),
    ]
    for s, runs in results.items():
        meds = [r["trace_median"] for r in runs if r.get("trace_median")]
        if not meds:
            continue

        def m(key: str, meds: Sequence[Mapping[str, Any]] = meds) -> float | None:
            vals = [float(x[key]) for x in meds if x.get(key) is not None]
            return statistics.median(vals) if vals else None

        cells = [_secs(m(key)) for _, key in TRACE_COLUMNS]
        busy, idle, steal = m("busy_cores"), m("idle_fraction"), m("steal_s")
        cells.append("-" if busy is None else f"{busy:.2f}")
        cells.append("-" if idle is None else f"{idle * 100:.0f} %")
        cells.append("-" if steal is None else f"{steal * 1e3:.0f} ms")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _ratio_table(results: Results) -> list[str]:
    lines = [
        "| ratio (median of per-round ratios; min..max) | value | target |",
        "|---|---|---|",
    ]
    for label, num, den, key, target in RATIOS:
        if num in results and den in results:
            a, b = (results[x][0].get("allocator") for x in (num, den))
            if "same allocator" in label and a != b:
                label = label.replace("same allocator", f"allocators differ: {a}, {b}")
            lines.append(f"| {label} | {_spread(per_round(results, num, den, key))} | {target} |")
    if "ssd" in results and "keep" in results and "stats" in results["keep"][0]:
        held = [
            a["stats"]["peak_resident_bytes"] / b["stats"]["peak_resident_bytes"]
            for a, b in zip(results["ssd"], results["keep"], strict=True)
            if b["stats"]["peak_resident_bytes"]
        ]
        lines.append(f"| ssd peak_resident_bytes / keep | {_spread(held)} | <= 0.25 |")
    return lines if len(lines) > 2 else []


def _codec_table(results: Results) -> list[str]:
    """Each ``X+codec`` label against ``X``: step time, bytes saved and written, per round."""
    lines = []
    for label in results:
        base = label.partition("+")[0]
        if "+" not in label or base not in results or "stats" not in results[base][0]:
            continue
        for what, key in (
            ("step time", "step_time_s"),
            ("saved bytes", "saved_bytes"),
            ("bytes written", "bytes_written"),
        ):
            ratios = []
            for a, b in zip(results[label], results[base], strict=True):
                va, vb = (r[key] if key == "step_time_s" else r["stats"][key] for r in (a, b))
                if vb:
                    ratios.append(va / vb)
            lines.append(f"| {label} {what} / {base} | {_spread(ratios)} |")
    if not lines:
        return []
    return [
        "| codec ratio (median of per-round ratios; min..max) | value |",
        "|---|---|",
        *lines,
        "",
    ]


def _identity(results: Results) -> list[str]:
    """Whether every run's final weights match keep's (ssd's decide; recompute's are reported)."""
    if "keep" not in results:
        return []
    ref = results["keep"][0]["weights_sha256"]
    lines = []
    for s in results:
        if s != "keep" and "+" not in s:
            same = {r["weights_sha256"] for r in (*results["keep"], *results[s])} == {ref}
            lines.append(
                f"Final weights bit-identical across keep and {s} runs: {'yes' if same else 'NO'}"
            )
    return [*lines, ""] if lines else []


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    return f"{_fmt(statistics.median(values))} ({_fmt(min(values))}..{_fmt(max(values))})"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _fmt(v: float) -> str:
    return f"{v:.3f}"
