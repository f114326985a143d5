"""``offloadd rok``: recompute-offload-keep (ROK) curves of a model on this machine.

One point per (strategy, batch size), each measured in its own process (``offloadd.tools.train``): one
warm-up step, then timed steps. Points go to ``DIR/rok.csv`` as they finish (``--resume`` skips
those already there), the machine to ``DIR/rok.json``, the figure to ``DIR/rok.png`` and a short
comparison to ``DIR/summary.txt`` and stdout. A point that runs out of memory is a recorded
point (status ``oom``), not the end of the sweep.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offloadd.config import Config, parse_size
from offloadd.io.files import default_offload_dir
from offloadd.runtime.stats import format_bytes
from offloadd.tools.machine import describe_machine, machine_line
from offloadd.tools.models.build import MODELS, default_vocab
from offloadd.tools.models.hf import HF_FAMILIES
from offloadd.tools.rok_summary import aggregate, summary_lines
from offloadd.tools.train import RunFailed, RunSpec, run_in_subprocess

__all__ = ["FIELDS", "STRATEGIES", "Sweep", "add_arguments", "main", "read_points"]

STRATEGIES = {"keep": "keep", "recompute": "recompute", "offload-ssd": "ssd", "offload-cpu": "cpu"}
"""``--strategies`` names -> ``RunSpec.strategy``. keep runs offloadd's hooks with the keep tier
(nothing moves, but its resident-byte accounting is there to compare)."""

FIELDS: dict[str, type] = {
    "model": str,
    "layers": int,
    "hidden": int,
    "heads": int,
    "seq": int,
    "vocab": int,
    "device": str,
    "steps": int,
    "strategy": str,
    "batch_size": int,
    "round": int,  # 1..--repeats
    "status": str,  # ok, oom or error
    "step_time_s": float,  # median of the timed steps
    "step_time_min_s": float,
    "samples_per_s": float,
    "tokens_per_s": float,
    "model_tflops": float,  # model FLOPs (6·N·tokens + attention) per second, recompute not counted
    "activation_peak_bytes": int,  # CUDA: device peak above the built model; CPU: peak RSS above it
    "peak_rss_above_base": int,
    "peak_device_above_base": int,
    "peak_resident_bytes": int,  # offloadd's own accounting (strategies with hooks)
    "saved_bytes": int,
    "bytes_written": int,
    "bytes_read": int,
    "io_wait_s": float,
    "params": int,
    "flops_per_step": int,
    "weights_sha256": str,
    "error": str,
}

_KEY = ("model", "layers", "hidden", "heads", "seq", "vocab", "device", "steps")
_SIZES: dict[str, dict[str, int]] = {
    "full": {"layers": 12, "hidden": 768, "heads": 12, "seq": 512, "steps": 3},
    "quick": {"layers": 4, "hidden": 256, "heads": 4, "seq": 256, "steps": 2},
}
_BATCH_SIZES = {"full": "1,2,4,8", "quick": "1,2,4"}


class UsageError(ValueError):
    """A bad argument, reported before any point runs."""


@dataclass(kw_only=True)
class Sweep:
    model: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch_sizes: list[int]
    strategies: list[str]
    device: str
    steps: int
    repeats: int
    out: Path
    ssd_dir: str | None
    offload_dir: str | None
    memory_limit: int
    point_timeout: float | None
    resume: bool
    plot: bool

    def key(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "seq": self.seq,
            "vocab": self.vocab,
            "device": self.device,
            "steps": self.steps,
        }

    def points(self) -> Iterator[tuple[int, int, str]]:
        """(round, batch size, strategy): round by round, batch size by batch size, every
        strategy in turn, so that drift and other load hit all strategies alike."""
        for n in range(1, self.repeats + 1):
            for b in self.batch_sizes:
                for s in self.strategies:
                    yield n, b, s

    def title(self) -> str:
        return (
            f"{self.model}: {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
            f"seq {self.seq}, vocab {self.vocab}; {self.steps} timed steps on {self.device}"
        )


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
        help="comma-separated from keep, recompute, offload-ssd, offload-cpu (CUDA only); "
        "default: all that apply to the device",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--ssd-dir", default=None, help="offload directory (default: per-user dir)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per point, after a warm-up")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure every point this many times, in rounds; plot and summary use the "
        "median over rounds (noisy or shared machines)",
    )
    p.add_argument("--out", default="rok", help="output directory (default: ./rok)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small sweep (4 layers, hidden 256, seq 256, batch 1,2,4, 2 steps) that takes a "
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


def _int_list(text: str, option: str) -> list[int]:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise UsageError(f"{option} must list at least one batch size, got {text!r}")
    try:
        values = [int(t) for t in parts]
    except ValueError:
        raise UsageError(f"{option} must be comma-separated integers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise UsageError(f"{option} must be positive, got {text!r}")
    return sorted(set(values))


def _check_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".rok-probe-"):
            pass
    except OSError as e:
        raise UsageError(f"--out {str(out)!r} is not a writable directory: {e}") from None


def resolve(ns: argparse.Namespace) -> Sweep:
    """Check every argument and fill in defaults; UsageError names the bad option."""
    kind = "quick" if ns.quick else "full"
    size = _SIZES[kind]
    if ns.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif ns.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device")
    else:
        device = ns.device
    layers = ns.layers if ns.layers is not None else size["layers"]
    hidden = ns.hidden if ns.hidden is not None else size["hidden"]
    heads = ns.heads if ns.heads is not None else size["heads"]
    seq = ns.seq if ns.seq is not None else size["seq"]
    steps = ns.steps if ns.steps is not None else size["steps"]
    for name, value in (
        ("--layers", layers),
        ("--hidden", hidden),
        ("--heads", heads),
        ("--seq", seq),
        ("--steps", steps),
        ("--repeats", ns.repeats),
    ):
        if value <= 0:
            raise UsageError(f"{name} must be positive, got {value}")
    if hidden % heads:
        raise UsageError(f"--heads ({heads}) must divide --hidden ({hidden})")
    if ns.vocab is not None and ns.vocab < 2:
        raise UsageError(f"--vocab must be at least 2, got {ns.vocab}")
    batch_sizes = _int_list(
        ns.batch_sizes if ns.batch_sizes is not None else _BATCH_SIZES[kind],
        "--batch-sizes",
    )
    if ns.strategies is None:
        strategies = ["keep", "recompute", "offload-ssd"]
        if device == "cuda":
            strategies.append("offload-cpu")
    else:
        strategies = [s.strip() for s in ns.strategies.split(",") if s.strip()]
        if not strategies:
            raise UsageError(f"--strategies must name at least one strategy, got {ns.strategies!r}")
        unknown = [s for s in strategies if s not in STRATEGIES]
        if unknown:
            raise UsageError(
                f"--strategies: unknown strategy {unknown[0]!r} "
                f"(choose from {', '.join(STRATEGIES)})"
            )
        strategies = list(dict.fromkeys(strategies))
    if "offload-cpu" in strategies and device != "cuda":
        raise UsageError(
            "--strategies: offload-cpu needs --device cuda; the cpu tier leaves CPU tensors where "
            "they are, so on CPU it would only measure keep again (use offload-ssd)"
        )
    if ns.model in HF_FAMILIES and importlib.util.find_spec("transformers") is None:
        raise UsageError(
            f"--model {ns.model} needs transformers: pip install 'offloadd[hf]' "
            "(or use --model mini-gpt)"
        )
    if not ns.no_plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "rok.png needs matplotlib: pip install 'offloadd[rok]' (or pass --no-plot)"
        )
    try:
        memory_limit = parse_size("--memory-limit", ns.memory_limit)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if memory_limit < 0:
        raise UsageError(f"--memory-limit must not be negative, got {ns.memory_limit!r}")
    if ns.point_timeout is not None and ns.point_timeout <= 0:
        raise UsageError(f"--point-timeout must be positive, got {ns.point_timeout}")
    offload_dir = None
    if "offload-ssd" in strategies or "offload-cpu" in strategies:
        try:
            cfg = Config.from_env(base=Config(ssd_dirs=(ns.ssd_dir,) if ns.ssd_dir else ()))
            offload_dir = cfg.ssd_dirs[0] if cfg.ssd_dirs else default_offload_dir()
        except ValueError as e:
            raise UsageError(f"--ssd-dir: {e}") from None
    out = Path(ns.out)
    _check_out(out)
    return Sweep(
        model=ns.model,
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=seq,
        vocab=ns.vocab if ns.vocab is not None else default_vocab(ns.model),
        batch_sizes=batch_sizes,
        strategies=strategies,
        device=device,
        steps=steps,
        repeats=ns.repeats,
        out=out,
        ssd_dir=ns.ssd_dir,
        offload_dir=offload_dir,
        memory_limit=memory_limit,
        point_timeout=ns.point_timeout,
        resume=ns.resume,
        plot=not ns.no_plot,
    )


def _parse(name: str, text: str) -> Any:
    if text == "":
        return None
    return FIELDS[name](text)


def read_points(path: Path) -> list[dict[str, Any]]:
    """The typed rows of a rok.csv; ValueError if its columns are not this version's."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != list(FIELDS):
            raise ValueError(f"{path} does not have the columns of this offloadd version")
        return [{k: _parse(k, v) for k, v in row.items()} for row in reader]


def _write_points(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(FIELDS))
        w.writeheader()
        for r in rows:
            w.writerow(r)
    os.replace(tmp, path)


def _row(sw: Sweep, strategy: str, batch: int, n: int, res: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {**sw.key(), "strategy": strategy, "batch_size": batch, "round": n}
    cuda = sw.device == "cuda"
    st = res.get("stats") or {}
    step = res["step_time_s"]
    ok = not res["oom"] and step is not None and math.isfinite(step) and step > 0
    row.update(
        status="ok" if ok else "oom",
        error=res.get("error"),
        peak_rss_above_base=res["peak_rss_above_base"],
        peak_device_above_base=res.get("peak_device_above_base"),
        activation_peak_bytes=res["peak_device_above_base"] if cuda else res["peak_rss_above_base"],
        peak_resident_bytes=st.get("peak_resident_bytes"),
        saved_bytes=st.get("saved_bytes"),
        bytes_written=st.get("bytes_written"),
        bytes_read=st.get("bytes_read"),
        io_wait_s=st.get("io_wait_s"),
        params=res["params"],
        flops_per_step=res["flops_per_step"],
        weights_sha256=res["weights_sha256"] if ok else None,
    )
    if ok:
        row.update(
            step_time_s=step,
            step_time_min_s=min(res["step_times_s"]),
            samples_per_s=batch / step,
            tokens_per_s=res["tokens_per_step"] / step,
            model_tflops=res["flops_per_step"] / step / 1e12,
        )
    return row


def _failed_row(
    sw: Sweep, strategy: str, batch: int, n: int, status: str, error: str
) -> dict[str, Any]:
    return {
        **sw.key(),
        "strategy": strategy,
        "batch_size": batch,
        "round": n,
        "status": status,
        "error": error,
    }


def _measure(sw: Sweep, strategy: str, batch: int, n: int) -> dict[str, Any]:
    spec = RunSpec(
        strategy=STRATEGIES[strategy],
        model=sw.model,
        num_layers=sw.layers,
        d_model=sw.hidden,
        num_heads=sw.heads,
        seq_len=sw.seq,
        vocab_size=sw.vocab,
        batch_size=batch,
        steps=sw.steps,
        device=sw.device,
        ssd_dir=sw.ssd_dir,
        memory_limit_bytes=sw.memory_limit,
    )
    try:
        return _row(sw, strategy, batch, n, run_in_subprocess(spec, timeout=sw.point_timeout))
    except subprocess.TimeoutExpired:
        return _failed_row(sw, strategy, batch, n, "error", f"timed out after {sw.point_timeout} s")
    except RunFailed as e:
        if e.returncode == -signal.SIGKILL:
            # What the kernel's OOM killer does to a process that outgrew the machine.
            return _failed_row(sw, strategy, batch, n, "oom", "killed by SIGKILL (out of memory?)")
        last = [ln for ln in e.stderr.strip().splitlines() if ln.strip()]
        msg = last[-1] if last else f"exit {e.returncode}"
        return _failed_row(sw, strategy, batch, n, "error", msg[:300])


def _point_line(r: dict[str, Any]) -> str:
    head = f"{r['strategy']:>12} batch {r['batch_size']:>4}" + (
        f" round {r['round']}: " if r.get("round", 1) > 1 else ": "
    )
    if r["status"] != "ok":
        return head + f"{r['status'].upper()} ({r['error']})"
    held = r["peak_resident_bytes"]
    return head + (
        f"{r['step_time_s']:.3f} s/step, {r['samples_per_s']:.2f} samples/s, "
        f"{r['model_tflops'] * 1e3:.1f} GFLOP/s, activations {format_bytes(r['activation_peak_bytes'])}"
        + (f" (offloadd holds {format_bytes(held)})" if held is not None else "")
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
    except UsageError as e:
        print(f"offloadd rok: {e}", file=sys.stderr)
        return 2
    csv_path = sw.out / "rok.csv"
    rows: list[dict[str, Any]] = []
    if sw.resume and csv_path.exists():
        try:
            rows = read_points(csv_path)
        except ValueError as e:
            print(f"offloadd rok: --resume: {e}", file=sys.stderr)
            return 2
        other = [r for r in rows if {k: r[k] for k in _KEY} != sw.key()]
        if other:
            print(
                f"offloadd rok: --resume: {csv_path} holds points of another sweep "
                f"({', '.join(f'{k}={other[0][k]}' for k in _KEY)}); use another --out",
                file=sys.stderr,
            )
            return 2
        rows = [r for r in rows if r["status"] in ("ok", "oom")]  # failed points run again
    elif csv_path.exists():
        print(f"offloadd rok: replacing {csv_path} (pass --resume to continue it)", flush=True)
    _write_points(csv_path, rows)
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
            row = _measure(sw, s, b, n)
            rows.append(row)
            _write_points(csv_path, rows)
            progress.done(_point_line(row))
    finally:
        progress.close()
    order = {s: i for i, s in enumerate(sw.strategies)}
    rows.sort(key=lambda r: (order.get(r["strategy"], 99), r["batch_size"], r["round"]))
    _write_points(csv_path, rows)
    points = aggregate(rows)
    lines = summary_lines(points)
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
            "measuring_s": round(time.time() - started, 1),
        },
        "summary": lines,
        "points": points,
        "rounds": rows,
    }
    (sw.out / "rok.json").write_text(json.dumps(report, indent=2) + "\n")
    if sw.plot:
        from offloadd.tools.rok_plot import plot

        plot(points, sw.out / "rok.png", f"{sw.title()}\n{machine_line(machine)}")
    print()
    print("\n".join(lines))
    print(
        f"\nwrote {csv_path}, {sw.out / 'rok.json'}"
        + (f", {sw.out / 'rok.png'}" if sw.plot else "")
        + f", {sw.out / 'summary.txt'}"
    )
    return 1 if any(r["status"] == "error" for r in rows) else 0
