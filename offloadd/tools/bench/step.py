"""``offloadd bench step``: step time and memory of plain PyTorch, keep, recompute and ssd offload.

The method (the same for the demo, ``rok`` and docs/benchmarks): each configuration runs in its
own process (clean peak RSS), the strategies interleaved round by round so that drift hits all of
them alike. Each run trains 3 untimed warm-up steps, then 8 timed ones, and reports their median,
with every step's record kept in the JSON (``--json``) so that drift shows; ``--trace`` prints
where the step's time goes (compute, offloadd's hooks, read and write waits, CPU idle, steal).

Baselines: ``none:system`` is plain PyTorch on glibc's heap. Every other strategy runs on
``--allocator`` (on a CPU machine offloadd's host cache, the allocator tier ssd uses there), so
that ssd / keep is the cost of offloading alone, with the allocator held equal. A label
``strategy[+codec][:allocator]`` sets either for one strategy: ``none:jemalloc`` and
``none:tcmalloc`` (preloaded) compare the host cache with the usual fast allocators.

The defaults are the built-in GPT (12 layers, d=768, seq 512, batch 2); the HF GPT-2 point is

    offloadd bench step --model gpt --layers 8 --d-model 512 --heads 8 --seq 512 --batch 4 \
        --vocab 2000
"""

# The docstring above is also the command's --help description (see bench.py). This module
# holds the options and the measurement; step_report turns the results into the report.

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from offloadd.cli_dirs import ready_dir, ready_parent
from offloadd.config import CodecConfig
from offloadd.offloader import Offloader
from offloadd.tools.bench.step_report import format_report
from offloadd.tools.harness.machine import command_line
from offloadd.tools.harness.options import add_model_arguments, model_kwargs
from offloadd.tools.harness.step_trace import ALLOCATORS, PRELOADED, cpu_allocator, preload_path
from offloadd.tools.harness.train import (
    STRATEGIES,
    RunSpec,
    run_in_subprocess,
    split_label,
)
from offloadd.tools.models.build import MODELS
from offloadd.tools.models.hf import HF_FAMILIES, require_transformers

__all__ = ["HELP", "add_arguments", "default_allocator", "hook_cost_us", "main"]

HELP = "step time and memory of plain, keep, recompute and ssd offload on one model, as ratios"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_model_arguments(p, layers=12, d_model=768, heads=12, seq=512, batch=2)
    p.add_argument(
        "--model",
        default="mini-gpt",
        choices=MODELS,
        help="mini-gpt (built in), or gpt, bert, t5 (transformers, random weights)",
    )
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the model's)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every strategy")
    p.add_argument(
        "--deep-layers", type=int, default=48, help="depth for the scaling check (0: skip)"
    )
    p.add_argument(
        "--strategies",
        default="none:system,keep,recompute,ssd",
        help="comma-separated, from none (plain PyTorch), keep, recompute, ssd, cpu; a codec "
        "after a plus runs that strategy with it (ssd+int8, compared with ssd in the report); "
        "an allocator after a colon runs it on that allocator (none:jemalloc)",
    )
    p.add_argument(
        "--allocator",
        default=None,
        choices=ALLOCATORS,
        help="torch's CPU allocator for strategies that name none (default: caching, "
        "offloadd's host cache, on a CPU machine; auto where CUDA is present)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also print where each strategy's step time goes (medians of the timed steps)",
    )
    p.add_argument(
        "--json",
        default=None,
        help="write every run's result, per-step records included, to this JSON file",
    )
    p.add_argument("--no-hook-cost", action="store_true", help="skip the hook cost measurement")
    p.add_argument(
        "--compile",
        action="store_true",
        help="every strategy runs the model compiled whole (torch.compile, inductor)",
    )
    p.add_argument(
        "--codec",
        default="none",
        help="offloadd's codec for keep, ssd and cpu (codec.name; lossy unless none)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="also write the markdown report here (its directory created, mode 0700, if missing)",
    )
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ for every run (same for all strategies)",
    )


def main(ns: argparse.Namespace) -> int:
    try:
        common = _options(ns)
    except (ValueError, ImportError) as e:
        print(f"offloadd bench step: {e}", file=sys.stderr)
        return 2
    if ns.malloc_mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(ns.malloc_mmap_threshold)
    strategies = [s for s in ns.strategies.split(",") if s]
    allocator = common.pop("allocator")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
    for r in range(ns.rounds):
        for s in strategies:
            print(f"round {r + 1}/{ns.rounds}: {s}", file=sys.stderr, flush=True)
            base, codec, alloc = split_label(s, ns.codec, allocator)
            spec = RunSpec(strategy=base, **common, codec=codec, allocator=alloc)
            results[s].append(run_in_subprocess(spec))
    hook_cost = None if ns.no_hook_cost else hook_cost_us()
    depth = None
    if ns.deep_layers:
        print(f"depth scaling: ssd at {ns.deep_layers} layers", file=sys.stderr, flush=True)
        once = dict(common, steps=1, warmup=1, allocator=allocator)
        shallow = run_in_subprocess(RunSpec(strategy="ssd", **once))
        deep = run_in_subprocess(RunSpec(strategy="ssd", **dict(once, num_layers=ns.deep_layers)))
        depth = (shallow, deep)
    report = format_report(
        ns,
        results,
        command=command_line(),
        hook_cost=hook_cost,
        depth=depth,
    )
    print(report)
    if ns.out:
        Path(ns.out).write_text(report + "\n")
    if ns.json:
        doc = {"command": command_line(), "allocator": allocator, "results": results}
        Path(ns.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _options(ns: argparse.Namespace) -> dict[str, Any]:
    """RunSpec fields shared by every run; ValueError or ImportError names what is wrong."""
    common = model_kwargs(ns)
    if ns.d_model % ns.heads:
        raise ValueError(f"--heads ({ns.heads}) must divide --hidden ({ns.d_model})")
    if ns.vocab is not None and ns.vocab <= 0:
        raise ValueError(f"--vocab must be positive, got {ns.vocab}")
    if ns.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {ns.rounds}")
    if ns.deep_layers < 0:
        raise ValueError(f"--deep-layers must be 0 (skip) or positive, got {ns.deep_layers}")
    try:
        CodecConfig(name=ns.codec)
    except ValueError as e:
        raise ValueError(f"--codec: {e}") from None
    strategies = [s for s in ns.strategies.split(",") if s]
    if not strategies:
        raise ValueError("--strategies: give at least one")
    allocator = ns.allocator or default_allocator()
    for s in strategies:
        base, codec, alloc = split_label(s, ns.codec, allocator)
        if base not in STRATEGIES or base == "auto":
            known = ", ".join(x for x in STRATEGIES if x != "auto")
            raise ValueError(f"--strategies: unknown {s!r}; known: {known}")
        try:
            CodecConfig(name=codec)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"--strategies {s!r}: {e}") from None
        if alloc not in ALLOCATORS:
            raise ValueError(
                f"--strategies {s!r}: unknown allocator {alloc!r}; known: {', '.join(ALLOCATORS)}"
            )
        if alloc in PRELOADED:
            try:
                preload_path(alloc)
            except ValueError as e:
                raise ValueError(f"--strategies {s!r}: {e}") from None
    if ns.model in HF_FAMILIES:
        require_transformers()  # ImportError naming the extra, before any run
    # last, so that a bad option creates nothing (Note [directories of the command line])
    if ns.ssd_dir:
        ready_dir("--ssd-dir", ns.ssd_dir)
    if ns.out:
        ready_parent("--out", ns.out)
    if ns.json:
        ready_parent("--json", ns.json)
    vocab = {"vocab_size": ns.vocab} if ns.vocab else {}
    return {**common, **vocab, "model": ns.model, "compile": ns.compile, "allocator": allocator}


def default_allocator() -> str:
    """The allocator ``bench step`` holds equal: the host cache on a CPU machine (what tier ssd
    uses there by default), auto (torch's own for the GPU runs) where CUDA is present."""
    return "auto" if torch.cuda.is_available() else cpu_allocator()


def hook_cost_us(ops: int = 5000, pairs: int = 15) -> dict[str, float]:
    """Microseconds added per saved small tensor (pack + unpack + release), over identity hooks.

    Runs alternate (identity, offloadd) ``pairs`` times; the minimum of each is compared, which
    filters out the noise of a shared machine with few cores."""
    x = torch.randn(16, requires_grad=True)
    off = Offloader(tier="keep")
    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def timed(ctx: Any) -> float:
        with ctx:
            t0 = time.perf_counter()
            for _ in range(ops // 100):
                y = x
                for _ in range(100):
                    y = y.sin()  # saves one small tensor each
                y.sum().backward()
            return time.perf_counter() - t0

    base, ours = [], []
    for _ in range(pairs):
        base.append(timed(identity))
        ours.append(timed(off))
    off.close()
    b, o = min(base) / ops * 1e6, min(ours) / ops * 1e6
    return {"identity_us": b, "offloadd_us": o, "added_us": o - b}
