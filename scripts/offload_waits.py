"""auto's plan against plain in one process, and how long backward waits for its read-backs.

The wall's goal model (HF GPT-2, 8 layers, d 512, seq 512, vocabulary 2000, AdamW) trains
under an Offloader with a budget until its planner has raced and settled, then steps plain
(the same model and optimizer, no hooks, on the same host cache) and auto in turn, reversed
every other round, one process, no memory limit: a ratio with the machine's drift paired out.
``--early`` adds a third arm, auto reading back one read-ahead window from backward's start
(before its first unpack; a block whose write has not ended by then is left to its unpack);
``--window`` sets the read-ahead window of every arm that reads (offloadd's: at most
``prefetch_bytes``). Each arm's ``read_wait_s`` and ``write_wait_s`` are backward's wait for
read-backs and forward's for writes, per step (``Stats``); ``x_plain`` is the ratio of the
arms' median steps, ``x_plain_rounds`` the ratio within each round.

    python scripts/offload_waits.py --batch 4 --budget 927MiB --ssd-dir /var/tmp/x
    python scripts/offload_waits.py --batch 4 --budget 927MiB --ssd-dir /dev/shm/x   # no disk
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from offloadd import Offloader
from offloadd.cli_dirs import ready_dir
from offloadd.tools.models.build import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--budget", required=True, help="auto's budget, e.g. 927MiB")
    p.add_argument("--ssd-dir", required=True)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--early", action="store_true", help="also: read back from backward's start")
    p.add_argument("--window", type=int, default=0, help="read-ahead window, MiB (0: offloadd's)")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    try:
        ready_dir("--ssd-dir", ns.ssd_dir)  # created 0700 if missing, as offloadd's options are
    except ValueError as e:
        raise SystemExit(str(e)) from None
    torch.manual_seed(0)
    built = build_model("gpt", num_layers=8, d_model=512, num_heads=8, seq_len=512, vocab_size=2000)
    opt = torch.optim.AdamW(built.module.parameters(), lr=1e-4)
    x = torch.randint(0, 2000, (ns.batch, 512), generator=torch.Generator().manual_seed(1))
    for w in built.module.parameters():
        w.grad = torch.zeros_like(w)
    opt.step()  # gradients and optimizer state exist before the host cache, as in the harness
    auto = Offloader(tier="ssd", ssd_dirs=[ns.ssd_dir], budget=ns.budget)
    runtime = auto.runtime
    reader = runtime.reader

    def step(off: Offloader | None, early: bool = False) -> float:
        t = time.perf_counter()
        if off is None:
            loss = built.loss(x, x)
        else:
            with off:
                loss = built.loss(x, x)
            if early:
                with runtime.lock:
                    reader.prefetch_below(1 << 62)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return time.perf_counter() - t

    for i in range(60):  # until the race has chosen the plan
        step(auto)
        plan = auto.plan()
        if plan is not None and plan.race is not None and i > 3:
            break
    plan = auto.plan()
    assert plan is not None
    if plan.race is None:
        print("warning: the planner's race had not ended after 60 steps")
    chosen = plan.decisions
    if ns.window:
        reader._size_window = lambda: ns.window << 20  # type: ignore[method-assign]
    arms = ["plain", "auto", *(["early"] if ns.early else [])]
    times: dict[str, list[float]] = {a: [] for a in arms}
    waits: dict[str, list[float]] = {a: [0.0, 0.0] for a in arms}  # read, write
    step(None)
    for r in range(ns.rounds):
        for arm in arms if r % 2 == 0 else reversed(arms):
            before = auto.stats()
            times[arm].append(step(None if arm == "plain" else auto, early=arm == "early"))
            after = auto.stats()
            waits[arm][0] += after.read_wait_s - before.read_wait_s
            waits[arm][1] += after.write_wait_s - before.write_wait_s
    plain = statistics.median(times["plain"])
    final = auto.plan()
    if final is None or final.decisions != chosen:
        print("warning: the plan changed while the arms were measured")
    out: dict[str, Any] = {
        "batch": ns.batch,
        "plan": "".join(d[0] for d in plan.decisions),
        "race": str(plan.race),  # the planner's own race: its plan against offloading all
        "window_bytes": reader.window,
        "buffered_io": auto.stats().buffered_io,
        "arms": {
            a: {
                "step_s": statistics.median(times[a]),
                "steps_s": times[a],
                "x_plain": statistics.median(times[a]) / plain,
                "x_plain_rounds": [t / q for t, q in zip(times[a], times["plain"], strict=True)],
                "read_wait_s": waits[a][0] / ns.rounds,
                "write_wait_s": waits[a][1] / ns.rounds,
            }
            for a in arms
        },
    }
    print(f"plan {out['plan']} (k: kept, o: offloaded; the head last)")
    for a, v in out["arms"].items():
        print(
            f"{a:>6}: {v['step_s']:.3f} s a step ({min(v['steps_s']):.2f}-{max(v['steps_s']):.2f}),"
            f" {v['x_plain']:.3f} x plain (rounds {min(v['x_plain_rounds']):.3f}-"
            f"{max(v['x_plain_rounds']):.3f}), waits for reads {v['read_wait_s']:.3f} s,"
            f" for writes {v['write_wait_s']:.3f} s"
        )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    auto.close()


if __name__ == "__main__":
    main()
