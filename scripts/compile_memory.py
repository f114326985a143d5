"""Memory under ``torch.compile``, read apart from compilation: the peak RSS up to the end of
the first step (compilation runs in it), then the peak of the steps after it alone (the
high-water mark reset after step 1: ``/proc/self/clear_refs``, ``VmHWM``). The process's
lifetime peak (what ``ps`` or ``/usr/bin/time -v`` report) is the larger of the two.

    python scripts/compile_memory.py [--steps 2] [--vocab 50257] [--arms A,B] [--out FILE]

HF GPT-2 (random weights, 4 layers, d=256, 4 heads, seq 256, batch 8, its 50,257-token
vocabulary or ``--vocab``), AdamW, one thread. Each arm in its own process, with a fresh inductor cache:
eager and ``torch.compile(model)`` (inductor), each without offloadd and with an Offloader of
the defaults (tier ssd; on a machine without CUDA, offloadd's host cache is torch's CPU
allocator), with the system allocator instead (held equal with plain's), and, compiled, with
``compile_ops=false`` (no ops in the graph: every saved tensor resident at the end of
forward). Each arm's losses are compared bit for bit with its mode's plain run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

ARMS = {
    "eager plain": ("eager", None),
    "eager offloadd": ("eager", {}),
    "eager offloadd (system allocator)": ("eager", {"host_allocator": "system"}),
    "compiled plain": ("compiled", None),
    "compiled offloadd": ("compiled", {}),
    "compiled offloadd (system allocator)": ("compiled", {"host_allocator": "system"}),
    "compiled offloadd (compile_ops=false)": ("compiled", {"compile_ops": False}),
}


def one(arm: str, steps: int, vocab: int) -> dict[str, Any]:
    import offloadd
    from offloadd.tools.harness import memory
    from offloadd.tools.models.hf import build_hf

    mode, options = ARMS[arm]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_hf(
        "gpt",
        num_layers=4,
        d_model=256,
        num_heads=4,
        seq_len=256,
        vocab_size=vocab,
        recompute=False,
    )
    run: Any = torch.compile(model) if mode == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (8, 256), generator=torch.Generator().manual_seed(1))
    off = None
    if options is not None:
        off = offloadd.Offloader(ssd_dirs=[tempfile.mkdtemp(prefix="compile-memory-")], **options)
    losses = []
    before = memory.rss()
    first_peak = after_first = 0
    for step in range(1 + steps):
        if off is None:
            loss = run(input_ids=ids, labels=ids).loss
        else:
            with off:
                loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 0:
            first_peak = memory.peak_rss_since_reset()  # the process's, compilation's included
            after_first = memory.rss()
            memory.reset_peak_rss()
    result = {
        "losses": losses,
        "before": before,
        "first_peak": first_peak,
        "after_first": after_first,
        "steps_peak": memory.peak_rss_since_reset(),
        "moved": off.stats().offloaded_bytes if off is not None else 0,
        "resident": off.stats().peak_resident_bytes if off is not None else 0,
    }
    if off is not None:
        off.close()
    return result


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2, help="measured steps after the first")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--arms", default=",".join(ARMS), help="a comma-separated subset")
    ap.add_argument("--one", metavar="ARM")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.steps, a.vocab)))
        return
    got: dict[str, dict[str, Any]] = {}
    for arm in a.arms.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "--steps", str(a.steps), "--vocab", str(a.vocab)]
            cmd += ["--one", arm]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        got[arm] = json.loads(done.stdout.splitlines()[-1])
        print(f"{arm}: {got[arm]}", file=sys.stderr, flush=True)
    lines = [
        f"HF GPT-2 4 layers, d=256, seq 256, batch 8, vocabulary {a.vocab}, AdamW, one thread; "
        f"{a.steps} measured "
        "steps after the first. RSS in MiB.",
        "",
        "| arm | before step 1 | peak in step 1 (compiles) | after step 1 | peak in steps 2.. | "
        "lifetime peak | steps' peak above before | steps' peak above after step 1 | "
        "offloadd's peak resident | losses = plain's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, r in got.items():
        plain = got[f"{ARMS[arm][0]} plain"]
        same = "" if ARMS[arm][1] is None else ("yes" if r["losses"] == plain["losses"] else "NO")
        lines.append(
            f"| {arm} | {_mib(r['before'])} | {_mib(r['first_peak'])} | {_mib(r['after_first'])} "
            f"| {_mib(r['steps_peak'])} | {_mib(max(r['first_peak'], r['steps_peak']))} | "
            f"{_mib(r['steps_peak'] - r['before'])} | {_mib(r['steps_peak'] - r['after_first'])} "
            f"| {_mib(r['resident'])} | {same} |"
        )
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
