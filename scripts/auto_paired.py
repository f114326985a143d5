"""auto against the single strategies, paired in one process: step-time ratios resolved to ~2 %.

Processes on this machine differ by 6-16 % from one another running the same plan, so rok's
process-per-point comparison cannot say whether auto is within 2 % of the best strategy. Here
every arm trains its own copy of the model (the same seed, the same batches) in one process, on
offloadd's host cache, and the arms take their steps in turns: A B C D, then D C B A, and so on,
so that a drift of the machine falls on all of them alike. Each step is timed from its forward
to the optimizer's step (as harness/train.py does). A round's ratio auto / X compares two steps
taken one after the other; the report gives, per pair, the median of those ratios and its 95 %
interval (order statistics of the rounds, no assumption about their distribution).

Arms: ``keep`` (offloadd's hooks, nothing moved), ``recompute`` (the model's checkpointed
blocks), ``ssd`` (offload every block; ``ssd/32MiB``: with ``staging_bytes`` 32 MiB, which bounds
the bytes its writes hold, as an auto plan's room does: Note [room for writes] in
offloadd/runtime/writer_in_place.py), and ``auto@B`` for each ``--budgets`` entry (tier ssd
under budget B: keep, offload or recompute per block, raced against offloading every block;
Note [race] in offloadd/auto/race.py). auto warms up until its planner settled, then one step
more, as train.py does; a replan during the timed rounds is reported. Memory is not compared
here (one process holds every arm): which strategies fit a budget is rok's to say.

    python scripts/auto_paired.py --batch 4 --budgets 0.5x --rounds 30 --out auto.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadd.auto import plan_dict
from offloadd.config import Config
from offloadd.offloader import Offloader
from offloadd.runtime import host_allocator
from offloadd.tools.harness.train import AUTO_WARMUP_MAX
from offloadd.tools.models.build import TrainModel, build_model, default_vocab


@dataclass
class Arm:
    name: str
    built: TrainModel
    opt: torch.optim.Optimizer
    off: Offloader | None
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    replans: int = 0
    rng: torch.Tensor = field(default_factory=lambda: torch.manual_seed(2).get_state())

    def step(self, batch: torch.Tensor) -> float:
        torch.set_rng_state(self.rng)  # each arm its own dropout stream, as in its own process
        t0 = time.perf_counter()
        if self.off is not None:
            with self.off:
                loss = self.built.loss(batch[:, :-1], batch[:, 1:])
        else:
            loss = self.built.loss(batch[:, :-1], batch[:, 1:])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        dt = time.perf_counter() - t0
        self.rng = torch.get_rng_state()
        self.losses.append(loss.item())
        return dt

    @property
    def settled(self) -> bool:
        return self.off is None or self.off.planner is None or self.off.planner.settled


def make_arm(name: str, a: argparse.Namespace, ssd_dir: str) -> Arm:
    torch.manual_seed(0)
    built = build_model(
        a.model,
        num_layers=a.layers,
        d_model=a.d_model,
        num_heads=a.heads,
        seq_len=a.seq,
        vocab_size=a.vocab,
        recompute=name == "recompute",
    )
    opt = torch.optim.AdamW(built.module.parameters(), lr=1e-3)
    off = None
    if name != "recompute":
        strategy, _, budget = name.partition("@")
        strategy, _, staging = strategy.partition("/")
        tier = "keep" if strategy == "keep" else "ssd"
        cfg = Config(tier=tier, ssd_dirs=(ssd_dir,), min_bytes=a.min_bytes)  # type: ignore[arg-type]
        if staging:  # ssd/32MiB: the sources its writes hold bounded as a budget's room does
            cfg = cfg.replace(staging_bytes=staging)
        off = Offloader(cfg.replace(budget=budget or None))
    return Arm(name, built, opt, off)


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """The distribution-free interval of the median: order statistics k and n - k + 1."""
    s = sorted(xs)
    n = len(s)
    k, below = 0, 0.0
    while k < n:  # largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2
        below_next = below + math.comb(n, k) / 2**n
        if below_next > (1 - level) / 2:
            break
        below, k = below_next, k + 1
    if k == 0:
        return s[0], s[-1]
    return s[k - 1], s[n - k]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mini-gpt")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--budgets", default="0.5x", help="auto's budgets, comma-separated")
    p.add_argument("--arms", default="keep,recompute,ssd", help="the single strategies")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--min-bytes", type=int, default=1 << 20)
    p.add_argument("--ssd-dir", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    names = [x for x in a.arms.split(",") if x] + [f"auto@{b}" for b in a.budgets.split(",") if b]
    ssd_dir = a.ssd_dir or tempfile.mkdtemp(prefix="offloadd-auto-paired-", dir="/var/tmp")
    host_allocator.acquire()  # every arm on the host cache, the Offloaders' allocator
    try:
        arms = [make_arm(n, a, ssd_dir) for n in names]
        return run(arms, a, names)
    finally:
        host_allocator.release()


def run(arms: list[Arm], a: argparse.Namespace, names: list[str]) -> int:
    vocab = a.vocab or default_vocab(a.model)
    gen = torch.Generator().manual_seed(1)

    def batch() -> torch.Tensor:
        return torch.randint(0, vocab, (a.batch, a.seq + 1), generator=gen)

    # Warm-up: every arm ``--warmup`` steps; an auto arm until its planner settled (profile,
    # race), then one step more under its final plan. The arms still warming take turns.
    warm = {arm.name: 0 for arm in arms}
    while True:
        due = [x for x in arms if warm[x.name] < a.warmup or not x.settled]
        due = [x for x in due if warm[x.name] <= AUTO_WARMUP_MAX]
        if not due:
            break
        b = batch()
        for arm in due:
            arm.step(b)
            warm[arm.name] += 1
    last = batch()
    for arm in arms:
        if not arm.settled:
            print(f"warning: {arm.name} did not settle in {warm[arm.name]} steps", flush=True)
        arm.step(last)  # one step under the settled plan, untimed
    print(f"warm-up steps: {warm}; {a.rounds} rounds", flush=True)
    for r in range(a.rounds):
        b = batch()
        for arm in arms if r % 2 == 0 else arms[::-1]:
            arm.times.append(arm.step(b))
            arm.replans += not arm.settled
        if (r + 1) % 10 == 0:
            print(f"  round {r + 1}/{a.rounds}", flush=True)
    report = summarize(arms)
    report["args"] = vars(a)
    for arm in arms:
        if arm.off is not None:
            plan = arm.off.plan()
            report["arms"][arm.name]["plan"] = plan_dict(plan) if plan is not None else None
            report["arms"][arm.name]["peak_held_bytes"] = arm.off.stats().peak_resident_bytes
            arm.off.close()
    print_table(report)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def summarize(arms: list[Arm]) -> dict[str, Any]:
    out: dict[str, Any] = {"arms": {}, "pairs": {}}
    for arm in arms:
        out["arms"][arm.name] = {
            "median_s": statistics.median(arm.times),
            "times_s": arm.times,
            "replanned_rounds": arm.replans,
            # lossless: the same losses as the first arm, bit for bit, wherever the two took
            # the same steps (an auto arm's longer warm-up trained on more batches)
            "losses_equal_first_arm": arm.losses == arms[0].losses
            if len(arm.losses) == len(arms[0].losses)
            else None,
        }
    for x in arms:
        if not x.name.startswith("auto@"):
            continue
        for y in arms:
            if y is x:
                continue
            ratios = [tx / ty for tx, ty in zip(x.times, y.times, strict=True)]
            lo, hi = median_interval(ratios)
            out["pairs"][f"{x.name} / {y.name}"] = {
                "median": statistics.median(ratios),
                "ci95": [lo, hi],
                "rounds": len(ratios),
            }
    return out


def print_table(report: dict[str, Any]) -> None:
    print("| arm | median step (s) | plan |")
    print("|---|---|---|")
    for name, arm in report["arms"].items():
        plan = arm.get("plan")
        decisions = [blk["decision"] for blk in plan["blocks"]] if plan else []
        what = " ".join(f"{d[0]}{decisions.count(d)}" for d in dict.fromkeys(decisions))
        print(f"| {name} | {arm['median_s']:.3f} | {what} |")
    print("\n| pair | median ratio | 95 % interval |")
    print("|---|---|---|")
    for pair, r in report["pairs"].items():
        print(f"| {pair} | {r['median']:.3f} | {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f} |")


if __name__ == "__main__":
    raise SystemExit(main())
