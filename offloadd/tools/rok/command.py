"""``offloadd rok``: recompute-offload-keep (ROK) curves of a model on this machine.

One point per (strategy, batch size), each measured in its own process
(``offloadd.tools.harness.train``): 3 warm-up steps, then 8 timed steps, their median (the method of
``bench step``; ``--quick``: 1 and 2). On a CPU machine every strategy runs on offloadd's host
cache, the allocator tier ssd uses there, so that offloading is compared with keep on the same
allocator. Points go to ``DIR/rok.csv`` as
they finish (``--resume`` skips those already there), the machine to ``DIR/rok.json``, the
figure to ``DIR/rok.png`` and a short comparison to ``DIR/summary.txt`` and stdout. A point that
runs out of memory is a recorded point (status ``oom``), not the end of the sweep.

The command's modules: this one (options, progress, the files written at the end),
``sweep`` (the options checked), ``points`` (one point measured; rok.csv),
``summary`` (what the points say) and ``plot`` (the figure).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from offloadd.auto.planner import WARMUP_STEPS as AUTO_WARMUP
from offloadd.auto.planner import WARMUP_STEPS_MAX as AUTO_WARMUP_MAX
from offloadd.tools.harness.machine import describe_machine, machine_line
from offloadd.tools.harness.train import warmup_steps
from offloadd.tools.models.build import MODELS
from offloadd.tools.rok.points import measure, point_line, read_points, write_points
from offloadd.tools.rok.summary import aggregate, summary_lines
from offloadd.tools.rok.sweep import KEY, Sweep, UsageError, resolve

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Measure recompute-offload-keep curves: peak activation memory against training "
        "throughput, one point per (strategy, batch size), each in its own process."
    )
    p.add_argument(
        "--model",
        default="mini-gpt",
        choices=MODELS,
        help="mini-gpt (built in, default) or gpt, bert, t5 (transformers, random weights)",
    )
    p.add_argument("--layers", type=int, default=None, help="blocks (T5: encoder and decoder each)")
    p.add_argument("--hidden", type=int, default=None, help="model width")
    p.add_argument("--heads", type=int, default=None, help="attention heads")
    p.add_argument("--seq", type=int, default=None, help="sequence length")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the model's)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated, e.g. 1,2,4,8")
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated from keep, recompute, offload-ssd, offload-cpu (CUDA only), auto "
        "(offloadd's planner under each of --budgets); default: keep, recompute, offload-ssd "
        "(and offload-cpu on CUDA)",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--ssd-dir",
        default=None,
        help="offload directory, created (mode 0700) if missing (default: per-user dir)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per point (default 8)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed steps per point first (default 3; auto {AUTO_WARMUP} to "
        f"{AUTO_WARMUP_MAX}: until its profile and race have settled)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure every point this many times, in rounds; plot and summary use the "
        "median over rounds (noisy or shared machines)",
    )
    p.add_argument(
        "--budgets",
        default="0.25x,0.5x,recompute",
        help="with the auto strategy: its budgets, each a point per batch size: sizes (6GiB), "
        "fractions of keep's footprint (0.3x), or recompute (recompute's measured peak at the "
        "same batch size; needs recompute listed before auto). Default 0.25x,0.5x,recompute",
    )
    p.add_argument(
        "--codec",
        default="none",
        help="offloadd's codec for keep, offload and auto points (codec.name: none, int8, "
        "fp8-e4m3, fp8-e5m2, int4, int2); lossy unless none; recompute is never coded",
    )
    p.add_argument(
        "--out",
        default="rok",
        help="output directory, created (mode 0700) if missing (default: ./rok)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small sweep (4 layers, hidden 256, seq 256, batch 1,2,4, 1 + 2 steps) that takes a "
        "few minutes on 2 CPU cores; explicit options still win",
    )
    p.add_argument("--resume", action="store_true", help="skip points already in DIR/rok.csv")
    p.add_argument(
        "--memory-limit",
        default="0",
        help="simulate a smaller machine: memory each point may use above the built model, "
        "e.g. 2GiB (CPU: an address-space limit, so approximate); points past it are OOM",
    )
    p.add_argument(
        "--point-timeout", type=float, default=None, help="seconds before a point is abandoned"
    )
    p.add_argument("--no-plot", action="store_true", help="skip rok.png (no matplotlib needed)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="every point runs the model compiled whole (torch.compile, inductor)",
    )


class _Progress:
    """tqdm's bar when tqdm is installed, else one line per point on stderr."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.n = total, done
        self.bar: Any = None
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="point", desc="rok", file=sys.stderr)
        except ImportError:
            pass

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)
        else:
            print(f"rok [{self.n + 1}/{self.total}] {label} ...", file=sys.stderr, flush=True)

    def done(self, line: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.write(line)
            self.bar.update(1)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(ns: argparse.Namespace) -> int:
    try:
        sw = resolve(ns)
        rows = _previous_rows(sw)
    except UsageError as e:
        print(f"offloadd rok: {e}", file=sys.stderr)
        return 2
    csv_path = sw.out / "rok.csv"
    write_points(csv_path, rows)
    machine = describe_machine(sw.device, sw.offload_dir)
    have = {(r["round"], r["batch_size"], r["strategy"]) for r in rows}
    todo = [p for p in sw.points() if p not in have]
    total = len(todo) + len(have)
    print(
        f"offloadd rok: {sw.title()}; strategies {', '.join(sw.strategies)}, batch sizes "
        f"{', '.join(map(str, sw.batch_sizes))}"
        + (f", {sw.repeats} rounds" if sw.repeats > 1 else "")
        + f": {len(todo)} points to measure"
        + (f" ({len(have)} already in {csv_path})" if have else "")
        + f"; {machine_line(machine)}",
        flush=True,
    )
    started = time.time()
    progress = _Progress(total, len(have))
    try:
        for n, b, s in todo:
            progress.start(f"{s} batch {b}" + (f" round {n}" if sw.repeats > 1 else ""))
            row = measure(sw, s, b, n, rows)
            rows.append(row)
            write_points(csv_path, rows)
            progress.done(point_line(row))
    finally:
        progress.close()
    order = {s: i for i, s in enumerate(sw.strategies)}
    rows.sort(key=lambda r: (order.get(r["strategy"], 99), r["batch_size"], r["round"]))
    write_points(csv_path, rows)
    lines = _write_results(sw, rows, machine, time.time() - started)
    print()
    print("\n".join(lines))
    print(
        f"\nwrote {csv_path}, {sw.out / 'rok.json'}"
        + (f", {sw.out / 'rok.png'}" if sw.plot else "")
        + f", {sw.out / 'summary.txt'}"
    )
    return 1 if any(r["status"] == "error" for r in rows) else 0


def _sweep_key(row: dict[str, Any], sw: Sweep) -> dict[str, Any]:
    """A row's ``KEY`` fields, its warm-ups those the sweep asked for where the run took the
    more its strategy needs (a row records what ran: auto at least ``train.AUTO_WARMUP``, and
    until its planner settled, up to ``train.AUTO_WARMUP_MAX``)."""
    key = {k: row[k] for k in KEY}
    strategy = "auto" if row["strategy"].startswith("auto@") else row["strategy"]
    least = warmup_steps(strategy, sw.warmup, compile=sw.compile)
    most = max(least, AUTO_WARMUP_MAX) if strategy == "auto" else least
    if isinstance(key["warmup"], int) and least <= key["warmup"] <= most:
        key["warmup"] = sw.warmup
    return key


def _previous_rows(sw: Sweep) -> list[dict[str, Any]]:
    """With ``--resume``, the points of DIR/rok.csv that need no new run; else none."""
    csv_path = sw.out / "rok.csv"
    if not sw.resume or not csv_path.exists():
        if csv_path.exists():
            print(f"offloadd rok: replacing {csv_path} (pass --resume to continue it)", flush=True)
        return []
    try:
        rows = read_points(csv_path)
    except ValueError as e:
        raise UsageError(f"--resume: {e}") from None
    other = [r for r in rows if _sweep_key(r, sw) != sw.key()]
    if other:
        raise UsageError(
            f"--resume: {csv_path} holds points of another sweep "
            f"({', '.join(f'{k}={other[0][k]}' for k in KEY)}); use another --out"
        )
    return [r for r in rows if r["status"] in ("ok", "oom", "infeasible")]  # failed: again


def _write_results(
    sw: Sweep, rows: list[dict[str, Any]], machine: dict[str, Any], measuring_s: float
) -> list[str]:
    """DIR/summary.txt, DIR/rok.json and DIR/rok.png from the measured rows; the summary."""
    points = aggregate(rows)
    lines = summary_lines(points, rows)
    if sw.repeats > 1:
        lines.insert(0, f"medians over {sw.repeats} rounds")
    (sw.out / "summary.txt").write_text("\n".join([sw.title(), *lines]) + "\n")
    report = {
        "machine": machine,
        "sweep": {
            **sw.key(),
            "strategies": sw.strategies,
            "batch_sizes": sw.batch_sizes,
            "repeats": sw.repeats,
            "memory_limit_bytes": sw.memory_limit,
            "offload_dir": sw.offload_dir,
            "command": sys.argv,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "measuring_s": round(measuring_s, 1),
        },
        "summary": lines,
        "points": points,
        "rounds": rows,
    }
    (sw.out / "rok.json").write_text(json.dumps(report, indent=2) + "\n")
    if sw.plot:
        from offloadd.tools.rok.plot import plot

        plot(points, sw.out / "rok.png", f"{sw.title()}\n{machine_line(machine)}")
    return lines
