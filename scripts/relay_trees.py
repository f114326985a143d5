"""Relay's swap from the host store in two trees of offloadd, timed in alternating processes.

A ratio the issue names against an earlier tree ("cut 3x" from the tree that measured 134 µs
a swap) cannot be read off figures taken on other days: this VM's host and load change, and an
absolute figure moves with them. Here each tree runs in its own process, the trees alternate
pair by pair, and every process times the same thing the same way: ``bench hooks``' micro model
(64 blocks, every Linear frozen, width 128, batch 8, one torch thread) plain and relayed (window
2, from a :class:`~offloadd.relay.store.HostStore`: relay's own work, no I/O), interleaved in
rounds of 5 steps. A process's figure is the median over its rounds of (relayed - plain) / 128
group swaps, in µs. The harness uses only what every tree since 2026-12-05 has
(``micro_model``, ``relay``, ``surface.open_store``, ``HostStore``). A tree is a checkout with
its C libraries built in place (``git worktree add /tmp/old COMMIT``, then
``python setup.py build_ext --inplace`` there).

``--floors`` times two more arms in the after tree's processes, in the same rounds: its
``scripts/relay_floor.py``'s minimal relay, and relay's hooks alone (``bench hooks``' floor arm),
after checking that relay's and the minimal relay's gradients are plain's. The after tree needs
both (any tree since 2026-12-07).

    python scripts/relay_trees.py --trees /tmp/old,. --pairs 8 --json trees.json
    python scripts/relay_trees.py --trees /tmp/old,. --pairs 8 --floors --json floors.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SWAPS = 128  # 64 groups, each swapped in forward and again in backward


def _inner(rounds: int, floors: bool) -> dict[str, object]:
    """In the tree PYTHONPATH picks: the median µs a swap above plain, and every round's;
    ``floors``: also the minimal relay's and relay's hooks alone (``relay_floor.py``), in the
    same rounds."""
    import torch
    from torch import nn

    from offloadd.relay import relay, surface
    from offloadd.relay.store import HostStore
    from offloadd.tools.bench.hooks import micro_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = micro_model(64, 128)
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            m.requires_grad_(False)
    opened = surface.open_store
    surface.open_store = lambda cfg, device, largest=0: HostStore()
    try:
        relayed = relay(copy.deepcopy(plain), window=2, tier="ssd")
    finally:
        surface.open_store = opened
    x = torch.randn(8, 128, requires_grad=True)
    arms = {"relay": relayed}
    ends: list[object] = []
    if floors:  # the floors of the tree PYTHONPATH picks, from its own relay_floor.py
        import offloadd

        sys.path.insert(0, str(Path(offloadd.__file__).parent.parent / "scripts"))
        from relay_floor import MinimalRelay

        from offloadd.tools.bench.hooks_arms import _hooked_like_relay

        arms["minimal"] = copy.deepcopy(plain)
        ends.append(MinimalRelay(arms["minimal"]))
        arms["hooks"] = _hooked_like_relay(copy.deepcopy(plain))
        want = torch.autograd.grad(plain(x).square().mean(), x)[0]
        for name in ("relay", "minimal"):  # timed only where their gradients are plain's
            got = torch.autograd.grad(arms[name](x).square().mean(), x)[0]
            for minimal in ends:
                minimal.end_step()  # type: ignore[attr-defined]
            if not torch.equal(want, got):
                raise SystemExit(f"relay_trees: the {name} arm's gradients differ from plain's")

    def steps(model: nn.Module, n: int = 5) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            model(x).square().mean().backward()
            for minimal in ends:
                minimal.end_step()  # type: ignore[attr-defined]
        return (time.perf_counter() - t0) / n

    steps(plain, 3)
    for model in arms.values():
        steps(model, 3)
    above: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(rounds):  # the order alternates round by round
        order = [("plain", plain), *arms.items()]
        times = {k: steps(m) for k, m in (order if r % 2 else reversed(order))}
        for k in arms:
            above[k].append((times[k] - times["plain"]) / SWAPS * 1e6)
    out: dict[str, object] = {"us_a_swap": statistics.median(above["relay"])}
    out["rounds_us"] = above.pop("relay")
    for k, v in above.items():
        out[f"{k}_us_a_swap"] = statistics.median(v)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default="", help="two checkouts, comma-separated: before,after")
    p.add_argument("--pairs", type=int, default=8, help="processes a tree, alternating")
    p.add_argument("--rounds", type=int, default=20, help="rounds a process")
    p.add_argument("--json", help="write every process's figures here")
    p.add_argument(
        "--floors",
        action="store_true",
        help="also time the minimal relay and relay's hooks alone in the after tree's processes",
    )
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.inner:
        print(json.dumps(_inner(ns.rounds, ns.floors)))
        return 0
    trees = [Path(t).resolve() for t in ns.trees.split(",") if t]
    if len(trees) != 2 or not all((t / "offloadd" / "__init__.py").is_file() for t in trees):
        p.error(f"--trees: two checkouts of offloadd, before,after; got {ns.trees!r}")
    runs: list[dict[str, object]] = []
    figures: list[list[float]] = [[], []]  # µs a swap: before's, after's
    for pair in range(ns.pairs):
        for which, tree in enumerate(trees):
            env = {**os.environ, "PYTHONPATH": str(tree)}
            cmd = [sys.executable, os.path.abspath(__file__), "--inner", "--rounds", str(ns.rounds)]
            cmd += ["--floors"] if ns.floors and which == 1 else []
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"relay_trees: {tree} failed:\n{out.stderr[-2000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append({"pair": pair, "tree": str(tree), **got})
            figures[which].append(got["us_a_swap"])
            floors = "".join(
                f", {k.removesuffix('_us_a_swap')} {v:.1f}"
                for k, v in got.items()
                if k.endswith("_us_a_swap")
            )
            print(
                f"  pair {pair + 1}: {tree}  {got['us_a_swap']:.1f} µs a swap{floors}", flush=True
            )
    before, after = figures
    ratios = [b / a for b, a in zip(before, after, strict=True)]
    print(
        f"before {statistics.median(before):.1f}, after {statistics.median(after):.1f} µs a swap "
        f"(medians); before / after per pair {min(ratios):.2f}-{max(ratios):.2f}, "
        f"median {statistics.median(ratios):.2f}"
    )
    after_runs = [r for r in runs if r["tree"] == str(trees[1])]
    for floor in ("minimal", "hooks"):
        key = f"{floor}_us_a_swap"
        got = [float(r[key]) for r in after_runs if key in r]  # type: ignore[arg-type]
        if got and len(got) == len(before):
            per = [b / g for b, g in zip(before, got, strict=True)]
            print(
                f"{floor}: {statistics.median(got):.1f} µs a swap (median); before / {floor} "
                f"per pair {min(per):.2f}-{max(per):.2f}, median {statistics.median(per):.2f}"
            )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(
                {"trees": [str(t) for t in trees], "runs": runs, "ratios": ratios}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
