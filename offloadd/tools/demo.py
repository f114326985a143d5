"""``offloadd demo``: the memory wall by default (demo_wall.py: plain PyTorch and offloadd under
one memory limit); with ``--full`` (and on a GPU), train the built-in GPT plain, with keep,
recompute and ssd offload at one batch size, and compare.

Each run is its own process, so that its peak RSS is its own, and trains 3 untimed warm-up steps
and 8 timed ones (the median is reported; the method of docs/benchmarks). Plain is PyTorch with
no hooks on glibc's heap. On a CPU machine keep and recompute run on offloadd's host cache, the
allocator ssd uses there, so that ssd against keep is the cost of offloading alone; the report
says apart what keep (the host cache and the hooks) changed against plain and what offloading
then cost. It is a table (step time, offloadd's peak resident activations, peak memory above the
model, bytes moved, I/O wait), those two sentences, and whether losses and final weights are
bit-identical to keep's. The exit status is 1 only when ssd's are not: the built-in GPT's
non-reentrant checkpointing is expected to be bit-identical too, and a mismatch of recompute (or
plain) is reported, but it is not offloadd's to answer for.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

from offloadd.cli_dirs import ready_dir
from offloadd.config import parse_size
from offloadd.runtime.stats import Stats
from offloadd.tools.harness.options import add_model_arguments, model_kwargs
from offloadd.tools.harness.spread import quotient_range, unresolved
from offloadd.tools.harness.step_trace import cpu_allocator
from offloadd.tools.harness.train import (
    RunFailed,
    RunSpec,
    run_in_subprocess,
)
from offloadd.units import format_bytes

__all__ = ["STRATEGIES", "add_arguments", "format_report", "main", "run_fields"]

STRATEGIES = ("plain", "keep", "recompute", "ssd")
"""The demo's runs, in the order they run and are shown."""

_TITLES = {"plain": "plain", "keep": "keep", "recompute": "recompute", "ssd": "ssd offload"}

Result = Mapping[str, Any]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.set_defaults(steps=None, warmup=None)  # the wall's runs: 2 and 1; --full's: 8 and 3
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--vocab", type=int, default=512, help="vocabulary (default 512)")
    p.add_argument(
        "--memory-limit",
        default="1GiB",
        help="the limit plain and offloadd train under (a memory cgroup; default 1GiB)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the full comparison instead: plain, keep, recompute and ssd at --batch, a table "
        "(always on a GPU)",
    )


def main(ns: argparse.Namespace) -> int:
    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    full = ns.full or device == "cuda"  # the wall's limit is a cgroup's: host memory
    ns.steps = ns.steps if ns.steps is not None else (8 if full else 2)
    ns.warmup = ns.warmup if ns.warmup is not None else (3 if full else 1)
    try:
        common = model_kwargs(ns)
        if ns.vocab <= 0:
            raise ValueError(f"--vocab must be positive, got {ns.vocab}")
        limit = parse_size("--memory-limit", ns.memory_limit)
        if limit <= 0:
            raise ValueError(f"--memory-limit must be positive, got {ns.memory_limit!r}")
        if ns.ssd_dir:  # before any run (Note [directories of the command line])
            ready_dir("--ssd-dir", ns.ssd_dir)
    except ValueError as e:
        print(f"offloadd demo: {e}", file=sys.stderr)
        return 2
    if not full:
        from offloadd.tools.demo_wall import wall_demo

        return wall_demo(ns, limit)
    common["vocab_size"] = ns.vocab
    print(
        f"offloadd demo: GPT {ns.layers} layers, d={ns.d_model}, seq {ns.seq}, batch {ns.batch}, "
        f"{ns.steps} timed steps after {ns.warmup} warm-ups on {device}, "
        f"{', '.join(STRATEGIES)}; each run in its own process",
        flush=True,
    )
    results: dict[str, Result | None] = {}
    shared = cpu_allocator() if device == "cpu" else "auto"
    for strategy in STRATEGIES:
        base, allocator = run_fields(strategy, shared)
        spec = RunSpec(strategy=base, allocator=allocator, device=device, **common)
        try:
            results[strategy] = run_in_subprocess(spec, progress=True)
        except RunFailed as e:
            if strategy in ("keep", "ssd"):
                raise
            # plain and recompute are references, not the subject: report and go on without
            print(
                f"offloadd demo: the {strategy} run failed (exit {e.returncode})", file=sys.stderr
            )
            results[strategy] = None
    report, ssd_identical = format_report(results, device=device)
    print()
    print(report)
    return 0 if ssd_identical else 1


def run_fields(strategy: str, shared: str) -> tuple[str, str]:
    """The RunSpec strategy and allocator of one of the demo's runs: plain is ``none`` on the
    system allocator; the others share ``shared`` (on a CPU machine the host cache, which ssd
    uses there: ``step_trace.cpu_allocator``)."""
    if strategy == "plain":
        return "none", "system"
    return strategy, shared


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
        "(peak saved activations held: offloadd's own accounting; plain and recompute run no hooks)"
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
    for name in ("plain", "recompute"):
        other = results.get(name)
        if other is not None:
            lines.append(
                f"losses and final weights bit-identical to keep: {name} "
                + (
                    "yes"
                    if _identical(keep, other)
                    else f"NO (reported only: {name} is not offloadd's)"
                )
                + f" (sha256 {other['weights_sha256'][:16]})"
            )
    for s in shown:
        r = results[s]
        if r is not None and r.get("oom"):
            lines.append(f"{_TITLES[s]} ran out of memory: {r['error']}")
    lines.append("ssd offload: " + Stats(**st).summary())
    return "\n".join(lines), ssd_identical


def _bought(results: Mapping[str, Result | None], mem_key: str, mem_short: str) -> str:
    """Two sentences: what keep's allocator and hooks together changed against plain PyTorch
    (bench step's ``none:caching`` tells the two apart), then what offloading cost against keep
    on the same allocator (and recompute's figures beside it)."""
    keep, ssd, plain = results["keep"], results["ssd"], results.get("plain")
    assert keep is not None and ssd is not None
    text = ""
    ref, ref_name = keep, "keep's"
    if plain is not None:
        ref, ref_name = plain, "plain PyTorch's"
        on = "offloadd's host cache (the allocator ssd uses)"
        if keep.get("allocator") != "caching":
            on = "the same allocator as plain PyTorch"
        text = (
            f"keep (the hooks on, nothing moved) on {on} ran at "
            f"{_ratio(keep['step_time_s'], plain['step_time_s'])} plain PyTorch's step time "
            "(plain: no hooks, glibc's heap). "
        )
    cost = ssd["step_time_s"] / keep["step_time_s"] - 1 if keep["step_time_s"] else math.nan
    text += (
        f"Offloading then {'cost' if not cost < 0 else 'saved'} {_percent(cost)} of keep's "
        f"step time (the same allocator; {_cost_range(ssd, keep)}) "
        f"to hold {_ratio(ssd[mem_key], ref[mem_key])} of {ref_name} {mem_short}"
    )
    recompute = results.get("recompute")
    if recompute is not None:
        text += (
            f"; recompute held {_ratio(recompute[mem_key], ref[mem_key])} at "
            f"{_ratio(recompute['step_time_s'], keep['step_time_s'])} keep's step time"
        )
    return text + "."


def _cost_range(ours: Result, ref: Result) -> str:
    """The range of ``ours``' step time over ``ref``'s the timed steps allow, and whether it
    resolves the difference (tools/harness/spread.py)."""
    a, b = ours.get("step_times_s"), ref.get("step_times_s")
    if not a or not b:
        return "no timed steps' range"
    lo, hi = quotient_range((min(a), max(a)), (min(b), max(b)))
    said = f"the timed steps allow {(lo - 1) * 100:+.0f} to {(hi - 1) * 100:+.0f} %"
    if unresolved((lo, hi)):
        said += ", which holds 0: this run does not resolve the difference"
    return said


def _percent(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{abs(x) * 100:.0f} %"


def _ratio(a: float, b: float) -> str:
    if not b or math.isnan(a) or math.isnan(b):
        return "n/a"
    return f"{a / b:.2f}x"


def _identical(a: Result, b: Result) -> bool:
    return bool(a["weights_sha256"] == b["weights_sha256"] and a["losses"] == b["losses"])
