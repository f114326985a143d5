"""What moving a step's activations through the disk costs this machine's compute, whoever moves
them: the floor under offloadd's ssd / keep step-time ratio on CPU.

    python scripts/io_floor.py [--mode whole] [--rounds 3] [--steps 8] [--out x.md]

One process trains ``scripts/bench_compile.py``'s model with tier keep and offloadd's host cache
(the allocator of the ssd runs), 3 untimed steps, then rounds of ``--steps`` timed steps alone
and ``--steps`` timed steps while fio, an independent program, moves the same bytes the way
offloadd's ssd tier does: O_DIRECT writes and reads of 4 MiB (``chunk_bytes``) through io_uring,
each at one step's activation bytes per keep step time, in two jobs (one writing, one reading a
file laid out before). The ratio of the two medians is what those bytes cost the step by
themselves: offloadd's ssd / keep ratio cannot go below it here. fio's own CPU time and the
bandwidth it reached are printed beside it, so that a twin that fell short of its rate shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_compile as bench  # the same model and sizes

CHUNK = 4 << 20


def cpu_times() -> list[int]:
    """/proc/stat's first line: user nice system idle iowait irq softirq steal (ticks)."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:9]]


def shares(a: list[int], b: list[int]) -> dict[str, float]:
    d = [y - x for x, y in zip(a, b, strict=True)]
    total = sum(d) or 1
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {n: v / total for n, v in zip(names, d, strict=True)}


def fio_cmd(directory: str, rate: int, size: int, seconds: float) -> list[str]:
    common = [
        f"--directory={directory}",
        "--direct=1",
        "--ioengine=io_uring",
        f"--bs={CHUNK}",
        "--iodepth=4",
        f"--size={size}",
        f"--rate={rate}",
        "--time_based",
        f"--runtime={int(seconds) + 1}",
        "--output-format=json",
    ]
    return ["fio", "--name=write", "--rw=write", *common, "--name=read", "--rw=read", *common]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("eager", "whole"), default="whole")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out")
    a = ap.parse_args()
    bench.N, bench.L = a.rows, a.layers
    import offloadd

    torch.manual_seed(0)
    model = bench.Model()
    run = torch.compile(model) if a.mode == "whole" else model
    x = torch.randn(bench.N, bench.D)
    off = offloadd.Offloader(offloadd.Config(tier="keep", host_allocator="caching"))
    weights = sum(p.nbytes for p in model.parameters() if p.dim() == 2)

    def step() -> float:
        t = time.perf_counter()
        with off:
            y = run(x)
        y.square().mean().backward()
        for p in model.parameters():
            p.grad = None
        return time.perf_counter() - t

    for _ in range(bench.WARMUP):
        step()
    saved0 = off.stats().saved_bytes
    keep_s = statistics.median(step() for _ in range(3))
    acts = (off.stats().saved_bytes - saved0) / 3 - weights  # what tier ssd moves a step
    rate = int(acts / keep_s)
    directory = tempfile.mkdtemp(prefix="io_floor_", dir=".")
    size = max(4 * int(acts), 64 * CHUNK)
    lay = ["fio", "--name=lay", f"--directory={directory}", "--direct=1", "--rw=write"]
    subprocess.run(
        [*lay, f"--bs={CHUNK}", f"--size={size}", "--filename=read.0.0"],
        check=True,
        capture_output=True,
    )
    alone: list[float] = []
    twin: list[float] = []
    fio_out: list[dict[str, object]] = []
    phase: dict[str, list[dict[str, float]]] = {"alone": [], "fio": []}
    for r in range(a.rounds):
        c0 = cpu_times()
        alone += [step() for _ in range(a.steps)]
        phase["alone"].append(shares(c0, cpu_times()))
        proc = subprocess.Popen(
            fio_cmd(directory, rate, size, keep_s * a.steps * 1.6 + 2),
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)  # fio up and at its rate
        c0 = cpu_times()
        twin += [step() for _ in range(a.steps)]
        phase["fio"].append(shares(c0, cpu_times()))
        out, _ = proc.communicate()
        jobs = json.loads(out[out.index("{") :])["jobs"]
        for j in jobs:
            side = j["write"] if j["jobname"] == "write" else j["read"]
            fio_out.append(
                {
                    "job": j["jobname"],
                    "MB/s": round(side["bw_bytes"] / 1e6, 1),
                    "cpu_usr_sys_%": round(j["usr_cpu"] + j["sys_cpu"], 1),
                }
            )
        print(f"round {r}: alone {alone[-a.steps :]}, with fio {twin[-a.steps :]}", file=sys.stderr)
    off.close()
    subprocess.run(["rm", "-rf", directory], check=True)
    ratio = statistics.median(twin) / statistics.median(alone)
    lines = [
        f"{a.mode}, {bench.L} blocks, {bench.N} rows, d={bench.D}; keep with the host cache; "
        f"{a.rounds} rounds of {a.steps} steps alone and {a.steps} with fio",
        "",
        f"- activations a step: {acts / 2**20:.0f} MiB; fio's rate each way: {rate / 1e6:.0f} MB/s",
        f"- step alone: median {statistics.median(alone):.3f} s "
        f"({', '.join(f'{t:.3f}' for t in alone)})",
        f"- step with fio: median {statistics.median(twin):.3f} s "
        f"({', '.join(f'{t:.3f}' for t in twin)})",
        f"- **with fio / alone: {ratio:.2f}**",
        "- fio per job and round: "
        + "; ".join(f"{f['job']} {f['MB/s']} MB/s, cpu {f['cpu_usr_sys_%']} %" for f in fio_out),
    ]
    for name, rows in phase.items():
        mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
        lines.append(
            f"- CPU while {name}: " + ", ".join(f"{k} {v:.1%}" for k, v in mean.items() if v)
        )
    bench.report(lines, a.out)


if __name__ == "__main__":
    main()
