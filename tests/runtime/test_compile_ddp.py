"""``torch.compile(DistributedDataParallel(model))``: DDP's optimizer splits one dynamo graph
into one AOT graph per bucket under one tracing context; each bucket's backward is compiled
later, in reverse, and must fetch what its own forward emptied (Note [emptied in the graph] in
offloadd/runtime/graph_ops.py, its part on keys).

Each case runs tests/_support/compile_ddp.py in a child process (a compiled backward that
reads an emptied tensor crashes the process), with a fresh inductor cache: compiled cold, the
post-grad pass places the ops; compiled again from that cache, it runs nowhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_bitwise_equal

CHILD = Path(__file__).resolve().parents[1] / "_support" / "compile_ddp.py"


def _run(out: Path, cache: Path) -> dict[str, Any]:
    """One child: the model without offloadd, then with it; its results."""
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(CHILD), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stderr[-3000:]}"
    result: dict[str, Any] = torch.load(out / "result.pt")
    return result


def _check(result: dict[str, Any]) -> None:
    assert_bitwise_equal(result["plain"], result["offloadd"])
    assert result["offloaded_bytes"] > 0
    assert result["evicts"] > 0  # the compiled forwards emptied what they saved
    assert result["live"] == 0


def test_ddp_buckets_fetch_what_their_forward_emptied(tmp_path: Path) -> None:
    """Before: the backward of the first bucket was placed with the names the second bucket's
    forward had emptied (none), so the first bucket's activation got no fetch, and its kernel
    read and wrote the 0-byte placeholder: SIGSEGV, with a cold cache only."""
    result = _run(tmp_path / "cold", tmp_path / "inductor")
    _check(result)
    assert result["unmatched"] == 0  # each backward was placed from its own forward's record


@pytest.mark.slow
def test_ddp_buckets_from_a_warm_cache(tmp_path: Path) -> None:
    """The same, compiled cold and then again from that cache. AOTAutograd's cache holds no
    graph of DDP's optimizer, so the forwards come from inductor's FX graph cache with their
    evicts and without a pass, and each backward is placed without its forward's record: it
    fetches every saved activation (Note [whose backward]). Before the fix a warm cache alone
    passed that way; the cold run crashed."""
    cold = _run(tmp_path / "cold", tmp_path / "inductor")
    _check(cold)
    assert cold["unmatched"] == 0
    warm = _run(tmp_path / "warm", tmp_path / "inductor")
    _check(warm)
    assert_bitwise_equal(cold["offloadd"], warm["offloadd"])
