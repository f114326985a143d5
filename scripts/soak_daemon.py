#!/usr/bin/env python3
"""Soak: an unmodified training script under ``OFFLOADD=1`` through a daemon that is killed
(SIGKILL) or stopped (SIGTERM, as ``offloadd stop``) and started again every few seconds.

The script imports nothing of offloadd. It trains a small MLP with AdamW for ``--steps`` steps
and prints each step's loss in hex; it runs once without offloadd (the reference) and once
with ``OFFLOADD=1 OFFLOADD_DAEMON_SOCKET=...``. While the second run trains, the daemon is
lost and restarted every ``--period`` seconds, whatever the trainer is doing (forward, backward,
between steps), and the trainer's open descriptors and RSS are sampled every half second.

It prints, and writes with ``--out`` as markdown: the steps run, the restarts, whether every
loss is bit-identical to the reference, the trainer's exit status, its descriptors and RSS in
the first and last tenth of the run (they must not grow), and any file left in the daemon's
directory. Exits 1 if the losses differ, the trainer failed, or a file was left.

    python scripts/soak_daemon.py --steps 2000 --period 8 \\
        --out docs/benchmarks/soak_daemon_cpu-2core_$(date +%F).md

``--trainer seams``: the features meet there instead (the seams grid's pairs, over thousands of
steps): an HF GPT-2 whose first three layers are frozen, with transformers' gradient
checkpointing, AdamW, an evaluation every 50 steps and, every 200, the model and optimizer saved
with ``torch.save`` and loaded back; under ``OFFLOADD_RELAY=frozen``, ``OFFLOADD_MEMSAVE=1`` and
``OFFLOADD_BUDGET=1GiB`` besides the daemon.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TRAIN = r"""
import sys
import torch
from torch import nn

steps = int(sys.argv[1])
torch.manual_seed(0)
model = nn.Sequential(
    *[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)]
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(steps):
    x = torch.randn(256, 256, generator=g)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(step, loss.item().hex(), flush=True)
"""


TRAIN_SEAMS = r"""
import io
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel

steps = int(sys.argv[1])
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=4, n_head=4, n_positions=64, vocab_size=512))
for layer in model.transformer.h[:3]:
    layer.requires_grad_(False)
model.gradient_checkpointing_enable()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(steps):
    x = torch.randint(0, 512, (8, 64), generator=g)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(step, loss.item().hex(), flush=True)
    if step % 50 == 49:
        model.eval()
        with torch.no_grad():
            print("eval", model(input_ids=x, labels=x).loss.item().hex(), flush=True)
        model.train()
    if step % 200 == 199:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
"""
TRAINERS = {"mlp": TRAIN, "seams": TRAIN_SEAMS}
SEAMS_ENV = {"OFFLOADD_RELAY": "frozen", "OFFLOADD_MEMSAVE": "1", "OFFLOADD_BUDGET": "1GiB"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    p.add_argument("--period", type=float, default=8.0, help="seconds between restarts")
    p.add_argument("--dir", default="/var/tmp", help="where the daemon's directory is made")
    p.add_argument("--out", help="write the result as markdown here")
    p.add_argument("--trainer", choices=sorted(TRAINERS), default="mlp", help="see above")
    return p.parse_args()


class Daemon:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = str(root / "run" / "daemon.sock")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "offloadd", "serve", "--socket", self.socket]
        with open(self.root / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--dir", str(self.root / "data")], stdout=log, stderr=log
            )
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"the daemon did not start: see {self.root / 'daemon.log'}")
            time.sleep(0.05)

    def lose(self, how: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(how)
        self.proc.wait(60)


def sample(pid: int) -> tuple[int, int] | None:
    """(open descriptors, RSS bytes) of ``pid``, or None once it is gone."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None
    return fds, rss


def main() -> int:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="offloadd-soak-", dir=args.dir))
    (root / "data").mkdir()
    script = root / "train.py"
    script.write_text(TRAINERS[args.trainer])
    print(f"soak in {root}: reference run ...", file=sys.stderr)
    ref = subprocess.run(
        [sys.executable, str(script), str(args.steps)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    daemon = Daemon(root)
    daemon.start()
    env = dict(
        os.environ,
        OFFLOADD="1",
        OFFLOADD_DAEMON_SOCKET=daemon.socket,
        OFFLOADD_MIN_BYTES="64KiB",
        OFFLOADD_CHUNK_BYTES="256KiB",
        OFFLOADD_STAGING_BYTES="4MiB",
        **(SEAMS_ENV if args.trainer == "seams" else {}),
    )
    with open(root / "train.err", "w") as err:
        trainer = subprocess.Popen(
            [sys.executable, str(script), str(args.steps)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    got: list[str] = []

    def read() -> None:
        assert trainer.stdout is not None
        for line in trainer.stdout:
            got.append(line.rstrip("\n"))

    reader = threading.Thread(target=read)
    reader.start()
    samples: list[tuple[int, int, int]] = []  # (steps done, fds, rss)
    kinds = (signal.SIGKILL, signal.SIGTERM)
    restarts, last, start = 0, time.monotonic(), time.monotonic()
    while trainer.poll() is None:
        time.sleep(0.5)
        s = sample(trainer.pid)
        if s is not None and got:
            samples.append((len(got), *s))
        if time.monotonic() - last > args.period:
            daemon.lose(kinds[restarts % 2])
            restarts += 1
            daemon.start()
            last = time.monotonic()
            print(f"  step {len(got)}/{args.steps}: restart {restarts}", file=sys.stderr)
    reader.join()
    daemon.lose(signal.SIGTERM)
    elapsed = time.monotonic() - start
    same = got == ref
    left = sorted(os.listdir(root / "data"))
    tenth = max(1, len(samples) // 10)

    def med(rows: list[tuple[int, int, int]], i: int) -> float:
        return statistics.median(r[i] for r in rows) if rows else float("nan")

    first, final = samples[:tenth], samples[-tenth:]
    lines = [
        "# Soak: the daemon lost and restarted under a running, unmodified training script",
        "",
        f"- command: `python scripts/soak_daemon.py --steps {args.steps} --period {args.period}"
        f" --trainer {args.trainer}`",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        (
            "- trainer: 4 blocks of Linear(256, 1024) + GELU + Linear(1024, 256), batch 256, AdamW"
            if args.trainer == "mlp"
            else "- trainer: HF GPT-2 (4 layers, d 128, seq 64, batch 8), the first 3 layers "
            "frozen, gradient checkpointing, AdamW, an eval every 50 steps, torch.save and "
            "load_state_dict every 200; `OFFLOADD_RELAY=frozen`, `OFFLOADD_MEMSAVE=1`, "
            "`OFFLOADD_BUDGET=1GiB`"
        )
        + "; `OFFLOADD=1`, `OFFLOADD_MIN_BYTES=64KiB`, `OFFLOADD_CHUNK_BYTES=256KiB`, "
        "`OFFLOADD_STAGING_BYTES=4MiB`, through `offloadd serve`",
        f"- restarts: every {args.period} s, alternately SIGKILL and SIGTERM",
        "",
        "| figure | value |",
        "|---|---|",
        f"| steps run | {sum(not line.startswith('eval') for line in got)} of {args.steps} |",
        f"| daemon restarts | {restarts} |",
        f"| losses bit-identical to the run without offloadd | {'yes' if same else 'NO'} |",
        f"| trainer's exit status | {trainer.returncode} |",
        f"| elapsed | {elapsed:.0f} s |",
        f"| trainer's open descriptors, median of the first / last tenth | "
        f"{med(first, 1):.0f} / {med(final, 1):.0f} (max {max(r[1] for r in samples)}) |",
        f"| trainer's RSS, median of the first / last tenth | "
        f"{med(first, 2) / 2**20:.0f} / {med(final, 2) / 2**20:.0f} MiB |",
        f"| files left in the daemon's directory | {len(left)} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    ok = same and trainer.returncode == 0 and not left
    if not ok:
        print(f"FAILED: see {root / 'train.err'} and {root / 'daemon.log'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
