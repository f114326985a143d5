#!/usr/bin/env python3
"""Turn an ``offloadd rok`` output directory into a results page under docs/benchmarks/.

Copies rok.csv, rok.json and rok.png next to the page as ``<stem>.csv`` / ``.json`` / ``.png`` and
writes ``<stem>.md``: the machine, the exact command, every point, and the sweep's summary.

    python scripts/rok_report.py /tmp/rok-bench/mini-gpt \
        docs/benchmarks/rok_mini-gpt_cpu-2core_2026-11-22 --note "other agents' tests ran too"
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import shutil
from pathlib import Path
from typing import Any

from offloadd.tools.harness.machine import machine_line
from offloadd.tools.rok.points import read_points
from offloadd.tools.rok.summary import aggregate, auto_rounds, summary_lines
from offloadd.units import format_bytes


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
    v = r.get(key)
    return "-" if v is None else format(v, fmt)


def _ms(r: dict[str, Any], key: str) -> str:
    return "-" if r.get(key) is None else f"{r[key] * 1e3:.0f} ms"


def _bytes(r: dict[str, Any], key: str) -> str:
    v = r.get(key)
    return "-" if v is None else format_bytes(v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("rok_dir", type=Path, help="an offloadd rok --out directory")
    p.add_argument("stem", type=Path, help="output path without suffix")
    p.add_argument("--note", action="append", default=[], help="a line for the page's notes")
    ns = p.parse_args()
    report = json.loads((ns.rok_dir / "rok.json").read_text())
    raw = read_points(ns.rok_dir / "rok.csv")
    rows = aggregate(raw)
    stem: Path = ns.stem
    stem.parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".csv", ".json", ".png"):
        src = ns.rok_dir / f"rok{suffix}"
        if src.exists():
            shutil.copyfile(src, stem.with_suffix(suffix))
    m, sw = report["machine"], report["sweep"]
    ran = {r["warmup"] for r in raw if r["strategy"].startswith("auto@") and r["status"] == "ok"}
    lo_hi = f"{min(ran)}-{max(ran)}" if ran and min(ran) != max(ran) else f"{max(ran, default=0)}"
    auto_warmup = f" (auto: {lo_hi}, until its profile and race settled)" if ran else ""
    cmd = sw["command"]
    if cmd and cmd[0].endswith("__main__.py"):
        cmd = ["offloadd", *cmd[1:]]
    disk = m.get("disk", {})
    lines = [
        f"# ROK curves: {sw['model']} on CPU ({m['logical_cores']} cores)",
        "",
        f"- finished: {sw['finished']} (measuring took {sw['measuring_s']:.0f} s)",
        f"- machine: {machine_line(m)}; {m['os']}; python {m['python']}"
        + (f", transformers {m['transformers']}" if "transformers" in m else ""),
        f"- offload directory: {disk.get('path', '-')} ({disk.get('fs', '?')} on "
        f"{disk.get('device', '?')})",
        f"- command: `{shlex.join(cmd)}`",
        f"- model: {sw['model']}, {sw['layers']} layers, hidden {sw['hidden']}, {sw['heads']} heads, "
        f"seq {sw['seq']}, vocab {sw['vocab']}; {sw['steps']} timed steps after "
        f"{sw.get('warmup', 1)} untimed ones{auto_warmup}, each point in its own process, {sw.get('repeats', 1)} round(s), strategies "
        "interleaved batch size by batch size; medians over rounds",
        "- memory: peak RSS above the RSS after the model, gradients and optimizer state were "
        "built; beside it, where offloadd's host cache was torch's allocator, its peak live bytes "
        "above the same point (what an auto budget bounds), and offloadd's own "
        "`peak_resident_bytes`",
        "- CPU stolen per step: the CPU time the hypervisor took from the machine's CPUs during "
        "a timed step (Linux's steal, all CPUs together, median over steps and rounds): where "
        "the host serves the virtual disk with the CPUs the guest trains on, the I/O's cost "
        "shows up here",
        *[f"- note: {n}" for n in ns.note],
        "",
        f"![ROK curves]({stem.with_suffix('.png').name})",
        "",
        "| strategy | batch | status (ok rounds) | median step time (s) | fastest step (s) | samples/s | model GFLOP/s | activation "
        "peak (RSS) | host cache live peak | offloadd peak resident | written | read | CPU stolen "
        "per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gflops = None if r["model_tflops"] is None else r["model_tflops"] * 1e3
        lines.append(
            f"| {r['strategy']} | {r['batch_size']} | {r['status']} ({r['ok_rounds']}/{r['rounds']}) | "
            f"{_cell(r, 'step_time_s', '.3f')} | {_cell(r, 'step_time_min_s', '.3f')} | "
            f"{_cell(r, 'samples_per_s', '.3f')} | "
            f"{'-' if gflops is None else f'{gflops:.1f}'} | "
            f"{_bytes(r, 'activation_peak_bytes')} | {_bytes(r, 'peak_live_above_base')} | "
            f"{_bytes(r, 'peak_resident_bytes')} | "
            f"{_bytes(r, 'bytes_written')} | {_bytes(r, 'bytes_read')} | "
            f"{_ms(r, 'steal_s')} |"
        )
    autos = [r for r in rows if r["strategy"].startswith("auto@")]
    if autos:
        lines += [
            "",
            "auto points: the budget on the memory axis, what offloadd was given (the axis budget less offload-ssd's RSS above "
            "the host cache's live peak, see [budgets on the axis] in offloadd/tools/rok/points.py), the "
            "plan's blocks kept / offloaded / recomputed, the memory used against the budget, and "
            "the race that chose the plan (offloading every block's step over the profile's plan's, "
            "the 95 % interval, the blocks of A B B A counted)",
            "",
            "| auto point | batch | budget (axis) | given to offloadd | plan | activation peak | "
            "used / budget | race |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in autos:
            used = (
                "-"
                if r.get("budget_bytes") is None or r.get("activation_peak_bytes") is None
                else f"{r['activation_peak_bytes'] / r['budget_bytes']:.2f}"
            )
            lines.append(
                f"| {r['strategy']} | {r['batch_size']} | {_bytes(r, 'budget_bytes')} | "
                f"{_bytes(r, 'held_budget_bytes')} | {r.get('plan') or r['status']} | "
                f"{_bytes(r, 'activation_peak_bytes')} | {used} | {r.get('race') or '-'} |"
            )
    per_round = auto_rounds(raw)
    if per_round:
        lines += [
            "",
            "auto per round: its throughput over the same round's run of the single strategy it "
            "is judged against (the fastest whose median memory fits its budget)",
            "",
            "| auto point | batch | per round |",
            "|---|---|---|",
        ]
        for (strategy, b), group in itertools.groupby(
            per_round, key=lambda p: (p["strategy"], p["batch_size"])
        ):
            cells = ", ".join(f"{p['ratio']:.3f}" for p in group)
            lines.append(f"| {strategy} | {b} | {cells} |")
    same = []
    for r in raw:
        if r["strategy"].startswith("offload") and r["status"] == "ok":
            keep = [
                k
                for k in raw
                if k["strategy"] == "keep"
                and k["status"] == "ok"
                and k["batch_size"] == r["batch_size"]
            ]
            same += [k["weights_sha256"] == r["weights_sha256"] for k in keep]
    if same:
        lines += [
            "",
            f"Final weights bit-identical between keep and offload at equal batch size: "
            f"{sum(same)}/{len(same)} pairs of runs.",
        ]
    lines += [
        "",
        "`offloadd rok`'s summary, computed again from the CSV (ratios are offload ÷ keep, "
        "offload ÷ recompute; auto ÷ the best single strategy within its budget, auto ÷ keep):",
        "",
    ]
    summary = summary_lines(rows, raw)
    if sw.get("repeats", 1) > 1:
        summary.insert(0, f"medians over {sw['repeats']} rounds")
    lines += ["```", *summary, "```", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
