"""Where relay's step time goes: its mechanics, and its disk reads beside a compute that uses
every core.

Copies of bench relay's frozen-backbone HF Llama train in one process, their steps interleaved
(A B C D, B C D A, ...: a drift of the machine falls on all alike), at each ``--threads``
setting of torch:

- ``plain``: the frozen weights resident;
- ``plain-reads``: the same, while relay's reads of the same bytes run at the same points of
  the step (each layer's group read before its forward and again before its backward but the
  last ``window``, which relay carries, ``window`` groups ahead, into slabs dropped unused): the
  disk reads alone, none of relay's mechanics;
- ``relay``: relayed through the ssd tier (O_DIRECT reads into slabs, as shipped);
- ``relay-memory``: relayed through a store that keeps each group in host memory and hands it
  out without I/O (the cpu tier's store, which relay takes only for GPU models): every hook,
  swap, ref, guard and on-demand path runs; no byte moves;
- ``relay-unguarded`` (only if named in ``--arms``): relay with its write guard off (Note [write
  guard] in relay/slabs.py), to price the guard.

relay-memory / plain is what the mechanics cost; plain-reads / plain is what the reads cost the
computation with nothing else changed, a floor under relay / plain on this machine. A last run
reads every group ``--io-reps`` times with nothing computing and reports the process's CPU
seconds per GiB read: the I/O's own CPU cost.

    python scripts/relay_cost.py --layers 32 --threads 2,1
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
    if how in ("plain", "plain-reads"):
        return model
    cfg = Config(tier="ssd", ssd_dirs=(ssd_dir,))
    if how == "relay-memory":
        opened = surface.open_store
        surface.open_store = lambda cfg, device, largest=0: HostStore()
        try:
            return offloadd.relay(model, config=cfg)
        finally:
            surface.open_store = opened
    model = offloadd.relay(model, config=cfg)
    if how == "relay-unguarded":
        state_of(model).relay.slabs.guarding = False
    return model


class Reads:
    """Relay's reads of ``relayed``'s groups, at the points of ``plain``'s step where relay would
    make them (see the module's docstring), their slabs dropped unused."""

    def __init__(self, plain: torch.nn.Module, relayed: torch.nn.Module) -> None:
        self.r = state_of(relayed).relay
        self.window = self.r.window
        self.fwd: dict[int, Any] = {}
        self.bwd: dict[int, Any] = {}
        n = len(self.r.groups)
        plain.register_forward_pre_hook(lambda m, a: self.ahead(self.fwd, range(self.window)))
        for k, g in enumerate(self.r.groups):
            layer = plain.get_submodule(g.name)
            layer.register_forward_pre_hook(
                lambda m, a, k=k: self.take(self.fwd, k, range(k + 1, min(n, k + self.window)))
            )
            layer.register_forward_hook(lambda m, a, out, k=k: self.on_output(out, k))

    def ahead(self, reads: dict[int, Any], ks: range | list[int]) -> None:
        for k in ks:
            if k not in reads:
                reads[k] = self.r.read(self.r.groups[k])

    def take(self, reads: dict[int, Any], k: int, then: range) -> None:
        t = reads.pop(k, None) or self.r.read(self.r.groups[k])
        self.ahead(reads, then)
        t.wait()

    def on_output(self, out: Any, k: int) -> None:
        t = out[0] if isinstance(out, tuple) else out
        if not t.requires_grad:
            return
        back = range(k - 1, max(-1, k - self.window), -1)
        if k >= len(self.r.groups) - self.window:  # relay carries these from forward
            carried = range(k - 1, max(-1, len(self.r.groups) - self.window - 1), -1)
            later = [j for j in back if j not in carried]
            t.register_hook(lambda grad: self.ahead(self.bwd, later))
        else:
            t.register_hook(lambda grad: self.take(self.bwd, k, back))


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
    pairs = [(a, b) for a, b in PAIRS if a in times and b in times]
    for a, b in pairs:
        ratios = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
        out[f"{a} / {b}"] = {
            "median": statistics.median(ratios),
            "quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]],
        }
    out["step_times_s"] = times
    return out


PAIRS = (
    ("relay-memory", "plain"),
    ("plain-reads", "plain"),
    ("relay", "plain"),
    ("relay", "relay-memory"),
    ("relay", "relay-unguarded"),
)


def io_cpu(model: torch.nn.Module, reps: int) -> dict[str, float]:
    r = state_of(model).relay
    used = resource.getrusage(resource.RUSAGE_SELF)
    t0, nbytes = time.perf_counter(), 0
    for _ in range(reps):
        pending = [r.read(g) for g in r.groups[:2]]
        for i, _g in enumerate(r.groups):
            t = pending.pop(0)
            t.wait()
            nbytes += t.nbytes
            del t
            if i + 2 < len(r.groups):
                pending.append(r.read(r.groups[i + 2]))
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
    p.add_argument(
        "--arms",
        default="plain,plain-reads,relay,relay-memory",
        help="of plain, plain-reads, relay, relay-memory, relay-unguarded (relay is needed)",
    )
    ns = p.parse_args()
    spec = RelaySpec(layers=ns.layers)
    arms = ns.arms.split(",")
    models = {h: build(spec, h, ns.ssd_dir) for h in arms}
    if "plain-reads" in models:
        Reads(models["plain-reads"], models["relay"])
    ids = torch.randint(
        0, spec.vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(1)
    )
    result: dict[str, Any] = {"layers": ns.layers, "by_threads": {}}
    for n in (int(x) for x in ns.threads.split(",")):
        torch.set_num_threads(n)
        result["by_threads"][n] = paired(models, ids, ns.rounds)
    result["io_alone"] = io_cpu(models["relay"], ns.io_reps)
    keys = [f"{a} / {b}" for a, b in PAIRS if a in models and b in models]
    print("| torch threads | plain | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for n, r in result["by_threads"].items():
        cells = [
            f"{r[k]['median']:.3f} ({r[k]['quartiles'][0]:.2f}-{r[k]['quartiles'][1]:.2f})"
            for k in keys
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
