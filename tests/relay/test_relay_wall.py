"""The memory wall: a fine-tune whose frozen weights are more than twice a hard memory limit (a
cgroup of the test's own) trains inside it with relay loading from the checkpoint, bit-identical
to the same fine-tune loaded whole without a limit (tests/_support/relay_wall.py; the
benchmark is scripts/relay_wall.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._support.cgroup import memory_cgroup
from tests._support.relay_wall import save_checkpoint

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
LIMIT = 450 * MIB


def _client(
    ckpt: Path, out: Path, mode: str, disk: Path, env: dict[str, str], **kw: object
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tests._support.relay_wall",
        str(ckpt),
        str(out),
        "--mode",
        mode,
        "--train",
        "lora",
        "--ssd-dir",
        str(disk),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{mode}: exit {r.returncode}\n{r.stderr[-3000:]}"


@pytest.mark.slow
def test_frozen_weights_twice_the_limit_train_inside_it(tmp_path: Path, disk_dir: Path) -> None:
    disk = disk_dir  # the store's files, on a disk file system
    frozen = save_checkpoint(tmp_path / "ckpt")
    assert frozen >= 2 * LIMIT
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    _client(tmp_path / "ckpt", tmp_path / "whole.json", "whole", disk, env)
    with memory_cgroup(LIMIT) as cg:
        # the limit is enforced: what holds 1.5 times it is killed
        hog = subprocess.run(
            [
                sys.executable,
                "-c",
                f"b = bytearray({LIMIT * 3 // 2}); b[::4096] = b'1' * len(b[::4096])",
            ],
            preexec_fn=cg.enter,
        )
        assert hog.returncode == -9 and cg.oom_killed()
    with memory_cgroup(LIMIT) as cg:
        run_env = dict(env, RELAY_WALL_CGROUP=str(cg.path))
        _client(
            tmp_path / "ckpt", tmp_path / "relay.json", "relay", disk, run_env, preexec_fn=cg.enter
        )
        assert not cg.oom_killed()
        peak = cg.peak()
    whole = json.loads((tmp_path / "whole.json").read_text())
    got = json.loads((tmp_path / "relay.json").read_text())
    assert got["losses"] == whole["losses"]
    a = torch.load(tmp_path / "whole.json.pt")
    b = torch.load(tmp_path / "relay.json.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert peak <= LIMIT and got["frozen_bytes"] >= 2 * LIMIT
    assert all(n >= got["frozen_bytes"] for n in got["read_bytes_per_step"])  # read each step
