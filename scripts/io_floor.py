"""What moving a step's activations through the disk costs this machine's compute, whoever moves
them: the floor under offloadd's ssd / keep step-time ratio on CPU.

    python scripts/io_floor.py [--mode whole] [--rounds 3] [--steps 8] [--out x.md]
    python scripts/io_floor.py --model gpt --layers 8 --d-model 512 --heads 8 --seq 512 \
        --batch 4 --vocab 2000     # the HF GPT-2 of bench step (or --model mini-gpt)

One process trains a model with tier keep and offloadd's host cache (the allocator of the ssd
runs): ``scripts/bench_compile.py``'s model by default, else one of ``bench step``'s models. It
first trains 2 steps with tier ssd to learn the bytes a step writes and reads back, then 3
untimed steps, then rounds of ``--steps`` timed steps alone and ``--steps`` timed steps while
fio, an independent program, moves those bytes the way offloadd's ssd tier does: O_DIRECT writes
and reads of 4 MiB (``chunk_bytes``) through io_uring, each at one step's bytes per keep step
time, in two jobs (one writing, one reading a file laid out before). The ratio of the two
medians is what those bytes cost the step by themselves: offloadd's ssd / keep ratio cannot go
below it here. fio's own CPU time and the bandwidth it reached are printed beside it, so that a
twin that fell short of its rate shows.
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
from collections.abc import Callable

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
    ap.add_argument("--model", default="compile-bench", help="compile-bench, mini-gpt, gpt, ...")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--ssd-dir", default=None, help="where the ssd steps write (default: ours)")
    ap.add_argument("--out")
    a = ap.parse_args()
    import offloadd

    torch.manual_seed(0)
    compute = _model(a)
    model_name = (
        f"{a.mode}, {bench.L} blocks, {bench.N} rows, d={bench.D}"
        if a.model == "compile-bench"
        else f"{a.model}, {a.layers} layers, d={a.d_model}, seq {a.seq}, batch {a.batch}"
        + (f", vocab {a.vocab}" if a.vocab else "")
    )

    def step(off: offloadd.Offloader) -> float:
        t = time.perf_counter()
        with off:
            loss = compute()
        loss.backward()
        return time.perf_counter() - t

    # the bytes tier ssd moves a step, from two ssd steps (the second one's)
    dirs = (a.ssd_dir,) if a.ssd_dir else ()
    ssd = offloadd.Offloader(offloadd.Config(tier="ssd", host_allocator="caching", ssd_dirs=dirs))
    step(ssd)
    ssd.synchronize()  # the first step's writes counted in the first step
    s0 = ssd.stats()
    step(ssd)
    ssd.synchronize()
    s1 = ssd.stats()
    ssd.close()
    written, read = s1.bytes_written - s0.bytes_written, s1.bytes_read - s0.bytes_read
    off = offloadd.Offloader(offloadd.Config(tier="keep", host_allocator="caching"))
    for _ in range(bench.WARMUP):
        step(off)
    keep_s = statistics.median(step(off) for _ in range(3))
    acts = max(written, read)
    if acts < CHUNK:
        raise SystemExit(f"io_floor: tier ssd moved {acts} bytes a step here: nothing to measure")
    rate = int(acts / keep_s)
    directory = tempfile.mkdtemp(prefix="io_floor_", dir=a.ssd_dir or ".")
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
        alone += [step(off) for _ in range(a.steps)]
        phase["alone"].append(shares(c0, cpu_times()))
        proc = subprocess.Popen(
            fio_cmd(directory, rate, size, keep_s * a.steps * 1.6 + 2),
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)  # fio up and at its rate
        c0 = cpu_times()
        twin += [step(off) for _ in range(a.steps)]
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
        f"{model_name}; keep with the host cache; "
        f"{a.rounds} rounds of {a.steps} steps alone and {a.steps} with fio",
        "",
        f"- tier ssd a step: {written / 2**20:.0f} MiB written, {read / 2**20:.0f} MiB read back; "
        f"fio's rate each way: {rate / 1e6:.0f} MB/s",
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


def _model(a: argparse.Namespace) -> Callable[[], torch.Tensor]:
    """The model's loss on a fixed batch, as a function (gradients accumulate: the step's
    memory does not change with them, and no optimizer runs in either phase)."""
    if a.model == "compile-bench":
        bench.N, bench.L = a.rows, a.layers
        model = bench.Model()
        run = torch.compile(model) if a.mode == "whole" else model
        x = torch.randn(bench.N, bench.D)
        return lambda: run(x).square().mean()
    from offloadd.tools.models.build import build_model, default_vocab

    built = build_model(
        a.model,
        num_layers=a.layers,
        d_model=a.d_model,
        num_heads=a.heads,
        seq_len=a.seq,
        vocab_size=a.vocab,
        recompute=False,
        compile=a.mode == "whole",
    )
    vocab = a.vocab or default_vocab(a.model)
    batch = torch.randint(0, vocab, (a.batch, a.seq + 1))
    return lambda: built.loss(batch[:, :-1], batch[:, 1:])


if __name__ == "__main__":
    main()
