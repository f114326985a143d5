"""Eager, per-block compile and whole-model compile, each with and without offloadd: peak resident
saved bytes as a fraction of a step's saved bytes, and step time against the same mode without
offloadd (Note [regions under compile] in offloadd/runtime/compiled.py).

    python scripts/bench_compile.py [--steps 8] [--out docs/benchmarks/compile_cpu.md]

Each (mode, offload) pair runs in its own process, in steady state (the first two steps, which
compile, are not timed), the pairs interleaved round by round; medians over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

MODES = ("eager", "per-block", "whole-no-ops", "whole")
D, H = 512, 2048
N, L = 1024, 8  # set by --rows and --layers
STAGING = 128 << 20  # set by --staging-mib


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


def one(mode: str, offload: bool, steps: int) -> dict[str, object]:
    import offloadd

    torch.manual_seed(0)
    model = Model()
    run: nn.Module = model
    if mode in ("whole", "whole-no-ops"):
        run = torch.compile(model)  # type: ignore[assignment]
    elif mode == "per-block":
        for b in model.blocks:
            b.compile()
    x = torch.randn(N, D)
    off = (
        offloadd.Offloader(
            offloadd.Config(
                ssd_dirs=[tempfile.mkdtemp(dir=".")],
                compile_ops=mode != "whole-no-ops",
                staging_bytes=STAGING,
            )
        )
        if offload
        else None
    )
    times: list[float] = []
    saved0 = 0
    for step in range(steps + 2):
        if step == 2 and off is not None:
            saved0 = off.stats().saved_bytes
        t = time.perf_counter()
        if off is not None:
            with off:
                y = run(x)
        else:
            y = run(x)
        y.square().mean().backward()
        if step >= 2:
            times.append(time.perf_counter() - t)
    out: dict[str, object] = {"mode": mode, "offload": offload, "step_s": statistics.median(times)}
    if off is not None:
        st = off.stats()
        per_step = (st.saved_bytes - saved0) / steps
        out.update(
            saved_per_step=per_step,
            peak_resident=st.peak_resident_bytes,
            ratio=st.peak_resident_bytes / per_step,
        )
        off.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", nargs=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--staging-mib", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args()
    global N, L, STAGING
    N, L, STAGING = a.rows, a.layers, a.staging_mib << 20
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1] == "1", a.steps)))
        return
    rows: dict[tuple[str, bool], list[dict[str, object]]] = {}
    for _ in range(a.rounds):
        for mode in MODES:
            for offload in (False, True):
                cmd = [
                    sys.executable,
                    __file__,
                    "--steps",
                    str(a.steps),
                    "--layers",
                    str(a.layers),
                    "--rows",
                    str(a.rows),
                    "--staging-mib",
                    str(a.staging_mib),
                    "--one",
                    mode,
                    str(int(offload)),
                ]
                res = json.loads(
                    subprocess.run(
                        cmd, check=True, capture_output=True, text=True
                    ).stdout.splitlines()[-1]
                )
                rows.setdefault((mode, offload), []).append(res)
    lines = [
        "| mode | step (keep) | step (ssd) | ssd / keep | saved a step | peak resident | peak / saved |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        keep = statistics.median(float(r["step_s"]) for r in rows[(mode, False)])  # type: ignore[arg-type]
        ssd = rows[(mode, True)]
        t = statistics.median(float(r["step_s"]) for r in ssd)  # type: ignore[arg-type]
        saved = statistics.median(float(r["saved_per_step"]) for r in ssd)  # type: ignore[arg-type]
        peak = max(float(r["peak_resident"]) for r in ssd)  # type: ignore[arg-type]
        lines.append(
            f"| {mode} | {keep:.3f} s | {t:.3f} s | {t / keep:.2f} | {saved / 2**20:.0f} MiB "
            f"| {peak / 2**20:.0f} MiB | {peak / saved:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
