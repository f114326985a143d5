"""Instructions relay adds a group swap, counted by valgrind's callgrind.

On this project's VM a relay swap's time moves by several microseconds between runs of the same
tree, as much as a round of cuts changes it. An instruction count does not move: each arm runs
in its own process under ``valgrind --tool=callgrind`` with instrumentation off, and after three
warm-up steps the process switches it on (``callgrind_control -i on``), runs ``--steps`` steps
of ``bench hooks``' micro model (64 blocks, every Linear frozen, width 128, batch 8, one torch
thread) and switches it off. Each figure is the arm's instructions a step less plain's, over the
128 group swaps a step. Arms:

- ``plain``: the model without relay (the baseline);
- ``hooks``: relay's hooks alone (``bench hooks --relay``'s floor arm);
- ``minimal``: ``scripts/relay_floor.py``'s minimal relay;
- ``relay``: relay from the host store (``bench hooks --relay``'s host-store arm);
- ``relay-py``: the same with relay's Python saved-tensor pair (``PassPack`` unset), as where
  offloadd.runtime._held is not built.

An instruction is not a nanosecond: a system call or a cache miss costs far more time than its
count, and ``rep movsb`` counts one instruction a byte (the copy of a group's 64.5 KiB is about
68.7k of each relay arm's count). Use it to compare trees and changes of Python and C work, and
time the result (``relay_floor.py``) where the machine allows. Needs valgrind.

    python scripts/relay_ir.py --arms plain,relay --json ir.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

ARMS = ("plain", "hooks", "minimal", "relay", "relay-py")
SWAPS = 128  # 64 groups, each swapped in forward and again in backward


def _run_arm(arm: str, steps: int) -> None:
    """Inside callgrind: build ``arm``, warm it up, count ``steps`` steps."""
    import torch
    from torch import nn

    from offloadd.tools.bench.hooks import micro_model
    from offloadd.tools.bench.hooks_arms import _hooked_like_relay, _relay_from_host

    torch.set_num_threads(1)
    plain = micro_model(64, 128)
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            m.requires_grad_(False)
    x = torch.randn(8, 128, requires_grad=True)
    after: Any = None
    if arm == "relay-py":
        from offloadd.relay import backward

        backward.PassPack = backward.PassUnpack = None
    if arm == "plain":
        model = plain
    elif arm == "hooks":
        model = _hooked_like_relay(copy.deepcopy(plain))
    elif arm == "minimal":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from relay_floor import MinimalRelay

        model = copy.deepcopy(plain)
        after = MinimalRelay(model).end_step
    else:
        model = _relay_from_host(copy.deepcopy(plain))

    def step() -> None:
        model(x).square().mean().backward()
        if after is not None:
            after()

    for _ in range(3):
        step()
    toggle = ["callgrind_control", "-i"]
    subprocess.run([*toggle, "on", str(os.getpid())], stdout=subprocess.DEVNULL, check=True)
    for _ in range(steps):
        step()
    subprocess.run([*toggle, "off", str(os.getpid())], stdout=subprocess.DEVNULL, check=True)


def _count(arm: str, steps: int) -> int:
    """The instructions ``steps`` steps of ``arm`` took, from callgrind's summary."""
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        os.path.abspath(__file__),
        "--inner",
        arm,
        "--steps",
        str(steps),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise SystemExit(f"relay_ir: the {arm} arm failed under valgrind:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"a comma list of {', '.join(ARMS)}")
    p.add_argument("--steps", type=int, default=10, help="steps counted an arm")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--inner", choices=ARMS, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.inner:
        _run_arm(ns.inner, ns.steps)
        return 0
    arms = [a for a in ns.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        p.error("needs valgrind and callgrind_control on PATH (apt install valgrind)")
    if "plain" not in arms:
        arms.insert(0, "plain")
    per_step: dict[str, float] = {}
    for arm in arms:
        print(f"  {arm} under callgrind ...", file=sys.stderr, flush=True)
        per_step[arm] = _count(arm, ns.steps) / ns.steps
    out = {
        "steps": ns.steps,
        "ir_per_step": per_step,
        "ir_per_swap_above_plain": {
            a: (v - per_step["plain"]) / SWAPS for a, v in per_step.items() if a != "plain"
        },
    }
    print(f"plain {per_step['plain'] / 1e6:.2f} M instructions a step; a group swap above plain:")
    for arm, v in out["ir_per_swap_above_plain"].items():
        print(f"  {arm:9s} {v / 1e3:7.1f} k")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
