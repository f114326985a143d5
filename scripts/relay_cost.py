"""Where relay's step time goes: its mechanics, and its disk reads beside a compute that uses
every core.

Three copies of bench relay's frozen-backbone HF Llama train in one process, their steps
interleaved (A B C, B C A, C A B, ...: a drift of the machine falls on all alike), at each
``--threads`` setting of torch:

- ``plain``: the frozen weights resident;
- ``relay``: relayed through the ssd tier (O_DIRECT reads into slabs, as shipped);
- ``relay-memory``: relayed through a store that keeps each group in host memory and hands it
  out without I/O (the cpu tier's store, which relay takes only for GPU models): every hook,
  swap, ref and on-demand path runs; no byte moves.

relay-memory / plain is what the mechanics cost; relay / relay-memory is what reading the same
bytes from disk costs while torch computes. A last run reads every group ``--io-reps`` times with
nothing computing and reports the process's CPU seconds per GiB read: the I/O's own CPU cost.

    python scripts/relay_cost.py --layers 16 --threads 2,1
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import statistics
import time
from typing import Any

import torch

import offloadd
from offloadd.config import Config
from offloadd.relay.store import HostStore
from offloadd.tools.bench.relay_run import RelaySpec, build_llama, freeze_backbone

surface = importlib.import_module("offloadd.relay.surface")
state_of = importlib.import_module("offloadd.relay.state").state_of


def build(spec: RelaySpec, how: str, ssd_dir: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_llama(spec)
    freeze_backbone(model)
    if how == "plain":
        return model
    cfg = Config(tier="ssd", ssd_dirs=(ssd_dir,))
    if how == "relay-memory":
        opened = surface.open_store
        surface.open_store = lambda cfg, device, largest=0: HostStore()
        try:
            return offloadd.relay(model, config=cfg)
        finally:
            surface.open_store = opened
    return offloadd.relay(model, config=cfg)


def step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def paired(models: dict[str, torch.nn.Module], ids: torch.Tensor, rounds: int) -> dict[str, Any]:
    names = list(models)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 2):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t = step(models[n], ids)
            if r >= 2:  # two untimed rounds: warm-up
                times[n].append(t)
    out: dict[str, Any] = {n: statistics.median(v) for n, v in times.items()}
    for a, b in (("relay-memory", "plain"), ("relay", "plain"), ("relay", "relay-memory")):
        ratios = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
        out[f"{a} / {b}"] = {
            "median": statistics.median(ratios),
            "quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]],
        }
    out["step_times_s"] = times
    return out


def io_cpu(model: torch.nn.Module, reps: int) -> dict[str, float]:
    r = state_of(model).relay
    used = resource.getrusage(resource.RUSAGE_SELF)
    t0, nbytes = time.perf_counter(), 0
    for _ in range(reps):
        pending = [r._read(g) for g in r.groups[:2]]
        for i, _g in enumerate(r.groups):
            t = pending.pop(0)
            t.wait()
            nbytes += t.nbytes
            del t
            if i + 2 < len(r.groups):
                pending.append(r._read(r.groups[i + 2]))
    wall = time.perf_counter() - t0
    now = resource.getrusage(resource.RUSAGE_SELF)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    gib = nbytes / 2**30
    return {"gib": gib, "gib_per_s": gib / wall, "cpu_s_per_gib": cpu / gib}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--threads", default="2,1", help="torch thread counts, comma-separated")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds per thread count")
    p.add_argument("--io-reps", type=int, default=6)
    p.add_argument("--ssd-dir", default="/var/tmp/offloadd-relay-bench")
    ns = p.parse_args()
    spec = RelaySpec(layers=ns.layers)
    models = {h: build(spec, h, ns.ssd_dir) for h in ("plain", "relay", "relay-memory")}
    ids = torch.randint(
        0, spec.vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(1)
    )
    result: dict[str, Any] = {"layers": ns.layers, "by_threads": {}}
    for n in (int(x) for x in ns.threads.split(",")):
        torch.set_num_threads(n)
        result["by_threads"][n] = paired(models, ids, ns.rounds)
    result["io_alone"] = io_cpu(models["relay"], ns.io_reps)
    print("| torch threads | plain | relay-memory / plain | relay / plain | relay / relay-memory |")
    print("|---|---|---|---|---|")
    for n, r in result["by_threads"].items():
        cells = [
            f"{r[k]['median']:.3f} ({r[k]['quartiles'][0]:.2f}-{r[k]['quartiles'][1]:.2f})"
            for k in ("relay-memory / plain", "relay / plain", "relay / relay-memory")
        ]
        print(f"| {n} | {r['plain']:.3f} s | " + " | ".join(cells) + " |")
    io = result["io_alone"]
    print(
        f"\nreads alone: {io['gib']:.2f} GiB at {io['gib_per_s']:.2f} GiB/s, "
        f"{io['cpu_s_per_gib']:.3f} CPU s per GiB"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
