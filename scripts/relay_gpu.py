"""Relay on one GPU: device memory and step time of a frozen-backbone fine-tune, relayed by
offloadd (tier cpu: pinned host records copied in on a side stream; tier ssd: O_DIRECT reads
copied in) against the weights resident and against FSDP2's ``CPUOffloadPolicy`` on one device
(PyTorch's own relay of the same bytes: every parameter kept in pinned host memory, each layer's
gathered to the device around its forward and backward).

The model is bench relay's HF Llama (``offloadd.tools.bench.relay_run``: random weights from a
config, every Linear weight of the decoder layers frozen, the rest trainable under AdamW), here in
bf16 by default. Each arm runs in its own process (clean device counters), the arms interleaved
round by round:

- ``plain``: the model on the GPU;
- ``relay-cpu``: built on the host, ``offloadd.relay(tier="cpu")``, then moved to the GPU;
- ``relay-ssd``: the same with ``tier="ssd"`` in ``--ssd-dir``;
- ``fsdp2-offload``: ``fully_shard`` per decoder layer and at the root with
  ``CPUOffloadPolicy()``, one rank (its optimizer then steps on the host).

Per arm: the most device memory allocated during the timed steps (``max_memory_allocated``,
after ``--warmup`` untimed steps), what stays allocated between steps, and the median step time
(synchronized). Saved at peak = plain's peak - the arm's; set beside the frozen bytes it is the
share of the frozen weights the arm keeps off the device. The losses are compared with plain's
(the first step's bit for bit; later ones follow flash attention's backward, which is not
deterministic from run to run: tests/relay/test_relay_cuda.py checks exactness with the math
kernel).

    python scripts/relay_gpu.py --out relay-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

ARMS = ("plain", "relay-cpu", "relay-ssd", "fsdp2-offload")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ssd-dir", default="/var/tmp/offloadd-relay-gpu")
    p.add_argument("--out", default=None, help="write every run's result as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(a: argparse.Namespace) -> tuple[torch.nn.Module, int]:
    from offloadd.tools.bench.relay_run import RelaySpec, build_llama, freeze_backbone

    spec = RelaySpec(
        layers=a.layers,
        hidden=a.hidden,
        intermediate=a.intermediate,
        heads=a.heads,
        vocab=a.vocab,
        seq=a.seq,
        batch=a.batch,
    )
    torch.manual_seed(0)
    model = build_llama(spec)
    if a.dtype == "bf16":
        model = model.to(torch.bfloat16)
    return model, freeze_backbone(model)


def child(a: argparse.Namespace) -> dict[str, Any]:
    arm = a.child
    dev = torch.device("cuda")
    model, frozen = build(a)
    if arm == "plain":
        model.to(dev)
    elif arm.startswith("relay-"):
        import offloadd
        from offloadd.config import Config

        tier = arm.removeprefix("relay-")
        os.makedirs(a.ssd_dir, exist_ok=True)
        cfg = Config(tier=tier, ssd_dirs=(a.ssd_dir,))  # type: ignore[arg-type]
        offloadd.relay(model, window=a.window, config=cfg)
        model.to(dev)
    elif arm == "fsdp2-offload":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0")
        os.environ.update(WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("cpu:gloo,cuda:nccl")
        mesh = init_device_mesh("cuda", (1,))
        for layer in model.get_submodule("model.layers"):
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    else:
        raise SystemExit(f"--arms: unknown arm {arm!r} (known: {', '.join(ARMS)})")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    losses: list[float] = []
    times: list[float] = []
    cpu: list[float] = []
    torch.cuda.synchronize()
    rest = torch.cuda.memory_allocated()
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            rest = torch.cuda.memory_allocated()
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the process's CPU before the sync (backward runs on autograd's device thread)
        cpu.append(time.process_time() - c0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out = {
        "arm": arm,
        "frozen_bytes": frozen,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "rest_bytes": rest,
        "step_s": statistics.median(times[a.warmup :]),
        "step_times": times,
        "cpu_s": statistics.median(cpu[a.warmup :]),
        "losses": losses,
    }
    if arm.startswith("relay-"):
        import dataclasses

        import offloadd

        out["relay"] = dataclasses.asdict(offloadd.relay_stats(model))
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return 0
    arms = [x for x in a.arms.split(",") if x]
    runs: list[dict[str, Any]] = []
    passthrough = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--out"]
    if a.out:
        passthrough = [x for x in passthrough if x != a.out]
    for r in range(a.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            cmd = [sys.executable, __file__, *passthrough, "--child", arm]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if done.returncode or line is None:
                print(f"{arm}: failed (rc {done.returncode})\n{done.stderr[-3000:]}", flush=True)
                runs.append({"arm": arm, "round": r, "failed": done.stderr[-3000:]})
                continue
            res = json.loads(line.removeprefix("RESULT "))
            res["round"] = r
            runs.append(res)
            print(
                f"round {r} {arm}: peak {res['peak_bytes'] / 2**20:.0f} MiB, at rest "
                f"{res['rest_bytes'] / 2**20:.0f} MiB, step {res['step_s'] * 1e3:.1f} ms, "
                f"process CPU {res['cpu_s'] * 1e3:.1f} ms",
                flush=True,
            )
    summary = summarize(runs)
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "runs": runs, "summary": summary}, f, indent=1)
    return 0 if all("failed" not in r for r in runs) else 1


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "failed" not in r]
    plain = [r for r in ok if r["arm"] == "plain"]
    out: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in ok):
        mine = [r for r in ok if r["arm"] == arm]
        row: dict[str, Any] = {
            "peak_mib": statistics.median(r["peak_bytes"] for r in mine) / 2**20,
            "rest_mib": statistics.median(r["rest_bytes"] for r in mine) / 2**20,
            "step_ms": statistics.median(r["step_s"] for r in mine) * 1e3,
            # the process CPU time a step (issuing work; near step_ms: CPU-bound)
            "process_cpu_ms": statistics.median(r["cpu_s"] for r in mine) * 1e3,
            "frozen_mib": mine[0]["frozen_bytes"] / 2**20,
        }
        if plain:
            p = plain[0]
            row["saved_at_peak_over_frozen"] = (p["peak_bytes"] - row["peak_mib"] * 2**20) / p[
                "frozen_bytes"
            ]
            row["step_over_plain"] = row["step_ms"] / (
                statistics.median(r["step_s"] for r in plain) * 1e3
            )
            # flash attention's backward is not deterministic run to run: after the first
            # update the losses may differ with or without relay (the tests use the math kernel)
            row["first_loss_equal_plain"] = all(r["losses"][0] == p["losses"][0] for r in mine)
            row["losses_equal_plain"] = all(r["losses"] == p["losses"] for r in mine)
        out[arm] = row
    return out


if __name__ == "__main__":
    raise SystemExit(main())
