"""What a codec costs per training step, against what it could save: the time spent encoding (in
forward's pack hooks) and decoding (in backward's unpack hooks), and the memory-bandwidth floor
of that work (reading the coded activations once and writing them back once).

A codec in front of the ssd tier pays off only when its encode + decode cost less than the I/O
time the smaller writes and reads save; this script measures the first term and the floor under
it, for the bench step model (``offloadd bench step`` measures the step times themselves).

    python scripts/codec_cost.py --codecs int8,fp8-e4m3,int4 --ssd-dir /var/tmp/rok-ssd

The model options (``--layers 8 --d-model 512 --heads 8 --seq 512 --batch 4 --steps 3`` by
default: the bench step point of docs/benchmarks/codec_step_*) are those of ``bench step``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import offloadd.codec.coder as coder
from offloadd.codec.quant import CODECS
from offloadd.tools.harness.options import add_model_arguments, model_kwargs
from offloadd.tools.harness.train import RunSpec, run


def measure(codec: str, args: argparse.Namespace) -> dict[str, float]:
    acc = {"encode_s": 0.0, "decode_s": 0.0, "coded_bytes": 0.0, "tensors": 0.0}
    encode, decode = coder.encode, coder.decode

    def timed_encode(x: torch.Tensor, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = encode(x, *a, **k)
        acc["encode_s"] += time.perf_counter() - t
        acc["coded_bytes"] += x.nbytes
        acc["tensors"] += 1
        return out

    def timed_decode(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = decode(*a, **k)
        acc["decode_s"] += time.perf_counter() - t
        return out

    coder.encode, coder.decode = timed_encode, timed_decode  # type: ignore[assignment]
    try:
        # step times come from `offloadd bench step` (a process per run; these share one)
        result = run(RunSpec(strategy="ssd", codec=codec, **model_kwargs(args)))
    finally:
        coder.encode, coder.decode = encode, decode  # type: ignore[assignment]
    steps = args.steps + result["warmup_steps"]  # the warm-up steps code too
    return {k: v / steps for k, v in acc.items()}


def bandwidth_floor(nbytes: int) -> tuple[float, float]:
    """Seconds to read, and to write, ``nbytes`` of float32 once (best of five, torch's threads)."""
    n = max(1, nbytes // 4)
    x, y = torch.randn(n), torch.empty(n)
    y.fill_(1.0)
    read = write = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        read = min(read, time.perf_counter() - t)
        t = time.perf_counter()
        y.fill_(0.5)
        write = min(write, time.perf_counter() - t)
    return read, write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--codecs", default="int8,fp8-e4m3,int4")
    add_model_arguments(p, layers=8, d_model=512, heads=8, seq=512, batch=4, steps=3)
    args = p.parse_args(argv)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    for c in codecs:
        if c not in CODECS or c == "none":
            p.error(f"--codecs: {c!r} is not one of {', '.join(CODECS[1:])}")
    print("| codec | coded per step | tensors | encode per step | decode per step |")
    print("|---|---|---|---|---|")
    largest = 0.0
    for c in codecs:
        m = measure(c, args)
        largest = max(largest, m["coded_bytes"])
        print(
            f"| {c} | {m['coded_bytes'] / 2**20:.0f} MiB | {m['tensors']:.0f} "
            f"| {1e3 * m['encode_s']:.0f} ms | {1e3 * m['decode_s']:.0f} ms |"
        )
    read, write = bandwidth_floor(int(largest))
    print(
        f"\nfloor for {largest / 2**20:.0f} MiB ({torch.get_num_threads()} threads): read once "
        f"{1e3 * read:.0f} ms ({largest / read / 1e9:.1f} GB/s), write once {1e3 * write:.0f} ms "
        f"({largest / write / 1e9:.1f} GB/s), together {1e3 * (read + write):.0f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
