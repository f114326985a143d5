"""Eager, per-block compile and whole-model compile, each with tier keep and tier ssd (or cpu):
peak resident saved bytes against a step's saved bytes and activations, and each tier's step time
against keep's in the same mode, the allocator held equal (Note [regions under compile] in
offloadd/runtime/compiled.py, Note [emptied in the graph] in offloadd/runtime/graph_ops.py).

    python scripts/bench_compile.py [--steps 8] [--rounds 2] [--out docs/benchmarks/x.md]
    python scripts/bench_compile.py --device cuda --tiers keep,cpu,ssd --rows 8192 --dim 1024

On CUDA the memory is the GPU's: the most bytes allocated during a step above those at its
start (torch.cuda.max_memory_allocated), and each step is timed between two synchronizes.

Each (mode, tier) pair runs in its own process with offloadd's host cache as torch's CPU
allocator on both sides, in steady state: three untimed steps (the first compiles), then
``--steps`` timed ones, whose median is quoted and whose per-step times are printed beside it;
the pairs interleaved round by round (keep, ssd, keep, ssd ...), so that drift shows. Memory
twice: offloadd's ledger (``peak_resident_bytes``: what it holds of saved tensors) and the
allocator's own count, the most CPU bytes live during a step above those live at its start
(the host cache's window), which also sees what a compiled graph still holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

MODES = ("eager", "per-block", "whole-no-ops", "whole")
WARMUP = 3
D, H = 512, 2048  # set by --dim (H = 4 D)
N, L = 1024, 8  # set by --rows and --layers
DEVICE = "cpu"  # set by --device


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def one(mode: str, tier: str, steps: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = Model().to(DEVICE)
    run: nn.Module = model
    if mode in ("whole", "whole-no-ops"):
        run = torch.compile(model)  # type: ignore[assignment]
    elif mode == "per-block":
        for b in model.blocks:
            b.compile()
    x = torch.randn(N, D, device=DEVICE)
    weights = sum(p.nbytes for p in model.parameters() if p.dim() == 2)  # what linears save
    import offloadd

    with tempfile.TemporaryDirectory(prefix="bench-compile-", dir=".") as ssd_dir:
        off = offloadd.Offloader(
            offloadd.Config(
                tier=tier,
                ssd_dirs=[ssd_dir],
                host_allocator="system" if DEVICE == "cuda" else "caching",
                compile_ops=mode != "whole-no-ops",
            )
        )
        try:
            return _measure(off, mode, tier, steps, run, model, x, weights)
        finally:
            off.close()  # before its directory goes


def _measure(
    off: Any,
    mode: str,
    tier: str,
    steps: int,
    run: nn.Module,
    model: nn.Module,
    x: torch.Tensor,
    weights: int,
) -> dict[str, object]:
    """One mode's steps through ``off`` (which the caller closes)."""
    cuda = DEVICE == "cuda"
    from offloadd.runtime import host_allocator

    cache = host_allocator.current()
    assert cache is not None or cuda, "the host cache did not load"
    times: list[float] = []
    above: list[int] = []  # the step's peak of live CPU bytes above its start (allocator)
    saved0 = 0
    for step in range(steps + WARMUP):
        if step == WARMUP:
            saved0 = off.stats().saved_bytes
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        else:
            assert cache is not None
            start = cache.reset_window()
        t = time.perf_counter()
        with off:
            y = run(x)
        y.square().mean().backward()
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
        if step >= WARMUP:
            times.append(time.perf_counter() - t)
            if cuda:
                above.append(torch.cuda.max_memory_allocated() - start)
            else:
                assert cache is not None
                above.append(cache.counters().window_peak_live_bytes - start)
    st = off.stats()
    per_step = (st.saved_bytes - saved0) / steps
    out: dict[str, object] = {
        "mode": mode,
        "tier": tier,
        "step_s": statistics.median(times),
        "steps_s": [round(t, 3) for t in times],
        "saved_per_step": per_step,
        "activations_per_step": per_step - weights,
        "peak_resident": st.peak_resident_bytes,
        "peak_above_start": max(above),
        "stats": st.summary(),
    }
    return out


def _f(r: dict[str, object], key: str) -> float:
    return float(r[key])  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", nargs=2, metavar=("MODE", "TIER"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--tiers", default="keep,ssd", help="keep first: the others against it")
    ap.add_argument("--out")
    a = ap.parse_args()
    global N, L, D, H, DEVICE
    N, L, D, H, DEVICE = a.rows, a.layers, a.dim, 4 * a.dim, a.device
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.steps)))
        return
    modes, tiers = a.modes.split(","), a.tiers.split(",")
    if tiers[0] != "keep" or len(tiers) < 2:
        ap.error("--tiers: keep first, then one or more of cpu, ssd")
    rows: dict[tuple[str, str], list[dict[str, object]]] = {}
    for r in range(a.rounds):
        for mode in modes:
            for tier in tiers:
                cmd = [sys.executable, __file__, "--steps", str(a.steps), "--layers"]
                cmd += [str(a.layers), "--rows", str(a.rows), "--dim", str(a.dim)]
                cmd += ["--device", a.device, "--one", mode, tier]
                done = subprocess.run(cmd, check=True, capture_output=True, text=True)
                res = json.loads(done.stdout.splitlines()[-1])
                rows.setdefault((mode, tier), []).append(res)
                print(f"round {r} {mode} {tier}: {res['steps_s']}", file=sys.stderr, flush=True)
    where = "GPU memory" if a.device == "cuda" else "allocator"
    lines = [
        f"{a.device}, {L} blocks, {N} rows, d={D}, h={H}; {a.steps} timed steps after {WARMUP}, "
        f"{a.rounds} round(s)",
        "",
        "| mode | tier | keep s/step | tier s/step | tier / keep (per round) | saved a step | "
        "activations a step | peak resident | peak / saved | peak / activations | step peak "
        f"above start, keep → tier ({where}) | tier / keep |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        keep = [_f(r, "step_s") for r in rows[(mode, "keep")]]
        a_keep = max(_f(r, "peak_above_start") for r in rows[(mode, "keep")])
        for tier in tiers[1:]:
            got = rows[(mode, tier)]
            t = [_f(r, "step_s") for r in got]
            saved = statistics.median(_f(r, "saved_per_step") for r in got)
            acts = statistics.median(_f(r, "activations_per_step") for r in got)
            peak = max(_f(r, "peak_resident") for r in got)
            per_round = ", ".join(f"{b / k:.2f}" for k, b in zip(keep, t, strict=True))
            a_tier = max(_f(r, "peak_above_start") for r in got)
            lines.append(
                f"| {mode} | {tier} | {statistics.median(keep):.3f} | {statistics.median(t):.3f} "
                f"| {statistics.median(t) / statistics.median(keep):.2f} ({per_round}) | "
                f"{saved / 2**20:.0f} MiB | {acts / 2**20:.0f} MiB | {peak / 2**20:.0f} MiB | "
                f"{peak / saved:.2f} | {peak / acts:.2f} | {a_keep / 2**20:.0f} → "
                f"{a_tier / 2**20:.0f} MiB | {a_tier / a_keep:.2f} |"
            )
    report(lines, a.out)


def report(lines: list[str], out: str | None) -> None:
    """Print the report, and write it to ``out`` if given (also scripts/io_floor.py's)."""
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
