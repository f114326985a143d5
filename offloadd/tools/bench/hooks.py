"""``offloadd bench hooks``: what offloadd costs the host per saved tensor, against a no-op pair.

On a GPU a step is often bound by the host issuing small kernels, so whatever offloadd does in
Python for each saved tensor is added to every step, even when nothing moves. This measures it
on a CPU-bound model of many tiny ops (``--model micro``: ``--blocks`` blocks of
``Linear(w, w) · GELU · LayerNorm``, batch ``--batch``; 512 saved tensors a step at the
defaults, a few KiB each), one process, one torch thread, the arms interleaved round by round so
that drift hits them alike, each a median over ``--rounds`` rounds of ``--steps`` steps after a
warm-up. Arms:

- ``none``: no hooks (the baseline every cost is above);
- ``noop``: a ``saved_tensors_hooks`` pair that returns what it is given (the floor of any hook);
- ``safe``: a pair whose pack detaches what is not a leaf, the floor of a hook that holds saved
  tensors without leaking (a saved output returned as it is would hold its own graph);
- ``keep-all``: tier keep with ``min_bytes=0`` (every tensor through offloadd's bookkeeping);
- ``keep``, ``ssd``: tier keep and tier ssd with their defaults (every tensor below
  ``min_bytes``: the cost of deciding to do nothing);
- ``ssd-all``: tier ssd with ``min_bytes=0`` (every tensor written to ``--dir`` and read back);
- ``daemon-all``: the same through an ``offloadd serve`` daemon started for the run;
- ``auto``: a budget (``--budget``, default ``0.5x``) planned over the blocks;
- ``cpu``, ``cpu-all``: tier cpu, where CUDA is present (the model then runs on the GPU).

For each: microseconds per saved tensor above ``none`` and the ratio to ``noop``'s (and to
``safe``'s, where that arm runs). With
``--model gpt2`` the model is a small HF GPT-2 (12 layers, d=128, seq 64, batch 2) and the
report is step time against ``none`` (the issue's "x plain"). ``relay`` (``--relay``) measures
relay's cost per group swap: the micro model with every block's Linear frozen and relayed
from host memory (relay's own host work) and from ssd (O_DIRECT reads: that work and the
disk's latency the window does not hide), against the same model plain, and against relay's
hooks alone (a pass-through pair pushed by each layer's hooks: the floor of relay's design).
Results: docs/benchmarks/.

    offloadd bench hooks --json hooks.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offloadd.cli_dirs import ready_parent
from offloadd.tools.bench.hooks_arms import ARMS, Arm, open_arms
from offloadd.tools.harness.machine import command_line, describe_machine, machine_line
from offloadd.tools.harness.spread import UNRESOLVED, fmt_ratio, quotient_range, unresolved

__all__ = [
    "HELP",
    "Micro",
    "add_arguments",
    "format_report",
    "main",
    "micro_model",
    "saved_per_step",
]

HELP = "host cost per saved tensor of each tier, against a no-op saved-tensor hook pair"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--model", choices=("micro", "gpt2"), default="micro")
    p.add_argument("--blocks", type=int, default=64, help="micro: blocks (default 64)")
    p.add_argument("--width", type=int, default=64, help="micro: Linear width (default 64)")
    p.add_argument("--batch", type=int, default=8, help="micro: batch (default 8)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {ARMS}")
    p.add_argument("--relay", action="store_true", help="also measure relay's cost per group")
    p.add_argument("--budget", default="0.5x", help="the auto arm's budget (default 0.5x)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    p.add_argument("--steps", type=int, default=5, help="steps per arm and round (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--dir", default=None, help="offload directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results here")


class Micro(nn.Module):
    """``blocks`` blocks of ``Linear(width, width) · GELU · LayerNorm`` in a ``ModuleList`` (the
    layers relay groups by)."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
            for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def micro_model(blocks: int, width: int) -> nn.Module:
    return Micro(blocks, width)


def _gpt2(device: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    from offloadd.tools.models.hf import build_hf

    model = build_hf(
        "gpt",
        num_layers=12,
        d_model=128,
        num_heads=4,
        seq_len=64,
        vocab_size=2000,
        recompute=False,
    )
    ids = torch.randint(0, 2000, (2, 64), device=device)
    return model.to(device), lambda m: m(input_ids=ids, labels=ids).loss


def saved_per_step(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]) -> int:
    """How many tensors one step saves for backward."""
    n = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal n
        n += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        loss = loss_of(model)
    loss.backward()
    return n


def _timed(step: Callable[[], None], steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def _interleave(
    steps: dict[str, Callable[[], None]], rounds: int, per_round: int
) -> dict[str, list[float]]:
    """Per-step seconds of each arm, round by round, the order reversed every other round."""
    names = list(steps)
    for name in names:  # warm-up: caches, the allocator's pools, the planner's first plans
        _timed(steps[name], 3 * per_round)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(_timed(steps[name], per_round))
        print(f"  round {r + 1}/{rounds}", file=sys.stderr, end="\r", flush=True)
    print(file=sys.stderr)
    return times


def _step_of(
    model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor], arm: Arm
) -> Callable[[], None]:
    def step() -> None:
        with arm.scope():
            loss = loss_of(model)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def _measure(ns: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loss_of: Callable[[nn.Module], torch.Tensor]
    if ns.model == "micro":
        model = micro_model(ns.blocks, ns.width).to(device)
        x = torch.randn(ns.batch, ns.width, device=device)

        def loss_of(m: nn.Module) -> torch.Tensor:
            return m(x).square().mean()

    else:
        model, loss_of = _gpt2(device)
    names = [a for a in ns.arms.split(",") if a]
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {ARMS}")
    saved = saved_per_step(model, loss_of)
    with open_arms(names, workdir, ns.budget, device) as arms:
        steps = {a.name: _step_of(model, loss_of, a) for a in arms if not a.skipped}
        times = _interleave(steps, ns.rounds, ns.steps)
        skipped = {a.name: a.skipped for a in arms if a.skipped}
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med.get("none")
    noop = med.get("noop")
    safe = med.get("safe")
    rows: dict[str, Any] = {}
    for name, m in med.items():
        row: dict[str, Any] = {"step_ms": m * 1e3, "steps_ms": [t * 1e3 for t in times[name]]}
        if base is not None:
            row["x_none"] = m / base
            row["us_per_saved"] = (m - base) / saved * 1e6
            if noop is not None and noop > base:
                row["x_noop"] = (m - base) / (noop - base)
            if safe is not None and safe > base:
                row["x_safe"] = (m - base) / (safe - base)
        rows[name] = row
    return {
        "model": ns.model,
        "saved_per_step": saved,
        "device": device,
        "arms": rows,
        "not_run": skipped,
    }


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path is not None:
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="offloadd-bench-hooks-", dir="/var/tmp") as d:
        yield Path(d)


def _lo_hi(row: dict[str, Any]) -> tuple[float, float] | None:
    """An arm's rounds' quartiles (ms a step): the middle half of its rounds, which one round
    disturbed by other load does not move; its fastest and slowest round below four rounds."""
    steps = row.get("steps_ms")
    if not steps:
        return None
    if len(steps) < 4:
        return min(steps), max(steps)
    q1, _, q3 = statistics.quantiles(steps, n=4)
    return q1, q3


def format_report(doc: dict[str, Any]) -> str:
    lines = [
        f"{doc['model']}: {doc['saved_per_step']} saved tensors a step on {doc['device']}",
        f"{'arm':<12}{'step ms':>10}{'rounds IQR ms':>17}{'x none (IQR)':>22}{'us/saved':>10}"
        f"{'x noop':>9}{'x safe':>9}",
    ]
    nan = float("nan")
    arms = doc["arms"]
    none = _lo_hi(arms["none"]) if "none" in arms else None
    said = False
    for name, row in arms.items():
        lo_hi = _lo_hi(row)
        rounds = f"{lo_hi[0]:.3f}-{lo_hi[1]:.3f}" if lo_hi else "-"
        x_none = "-"
        if "x_none" in row:
            rng = quotient_range(lo_hi, none) if lo_hi and none and name != "none" else None
            x_none = fmt_ratio(row["x_none"], rng, unit="")
            said = said or unresolved(rng)
        lines.append(
            f"{name:<12}{row['step_ms']:>10.3f}{rounds:>17}{x_none:>22}"
            f"{row.get('us_per_saved', nan):>10.2f}{row.get('x_noop', nan):>9.2f}"
            f"{row.get('x_safe', nan):>9.2f}"
        )
    for name, why in doc.get("not_run", {}).items():
        lines.append(f"{name:<12}not run: {why}")
    if said:
        lines.append(UNRESOLVED)
    if "relay" in doc:
        r = doc["relay"]
        for store in ("host", "ssd"):
            a = r[store]
            lo, hi = a.get("us_per_swap_range", (nan, nan))
            lines.append(
                f"relay ({store} store): {a['swaps_per_step']} group swaps a step, "
                f"{a['us_per_swap']:.1f} us each above plain (rounds {lo:.1f}-{hi:.1f}; "
                f"{a['x_plain']:.3f} x plain's step); "
                f"relay's hooks alone: {a['floor_us_per_swap']:.1f} us"
            )
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    torch.set_num_threads(ns.threads)
    torch.manual_seed(0)
    with _workdir(ns.dir) as workdir:
        doc = _measure(ns, workdir)
        if ns.relay:
            from offloadd.tools.bench.hooks_arms import relay_cost

            doc["relay"] = relay_cost(ns, workdir, micro_model)
    doc["machine"] = describe_machine(doc["device"])
    doc["command"] = command_line()
    doc["threads"] = ns.threads
    print(machine_line(doc["machine"]))
    print(format_report(doc))
    if ns.json:
        ready_parent("--json", ns.json)
        path = Path(ns.json)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
    return 0
