"""The distributed rows of the composition matrix: FSDP2, FSDP2 with CPUOffloadPolicy, DDP, and
tensor parallel with sequence parallel, on two gloo ranks under one torchrun launch.

tests/_support/ranks/matrix_dist.py trains each row without and with an explicit Offloader. Per rank
and row: losses, gradients and final weights bitwise equal, bytes moved, no parameter (plain,
all-gathered, sharded or DTensor) ever handed to the mover, nothing left in the offload dirs.
"""

from __future__ import annotations

import json
import socket
import warnings
from pathlib import Path
from typing import Any

import torch

from tests._support.envrun import RANKS, clean_env, run
from tests._support.helpers import MakeOffloader

# scripts that use offloadd explicitly (not clients)

ENGINE_PARAMS = ("default",)  # the ranks choose the engine (auto), as users get it

ROWS = ("fsdp2", "fsdp2_cpu_offload", "ddp", "tp_sp")
# torch 2.13's CPU wheel: a gloo rank sometimes aborts in C++ while the group starts or ends,
# with or without offloadd (see tests/integrations/test_clients.py::test_torchrun_ddp_two_ranks)
TORCH_ABORT = "terminate called without an active exception"


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _launch(out_dir: Path) -> dict[int, dict[str, Any]]:
    for attempt in (1, 2):
        cmd = [
            "torchrun",
            "--nproc_per_node=2",
            f"--master_port={_port()}",
            str(RANKS / "matrix_dist.py"),
            str(out_dir),
        ]
        try:
            proc = run(cmd, clean_env(), timeout=240)
        except AssertionError as e:
            # One retry for that abort only: it is no numerical outcome.
            if attempt == 2 or TORCH_ABORT not in str(e):
                raise
            warnings.warn(f"torchrun rank aborted in C++; retrying once: {cmd}", stacklevel=1)
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"rank"')]
        results = [json.loads(ln) for ln in lines]
        return {int(r["rank"]): r for r in results}
    raise AssertionError("unreachable")


def test_fsdp2_ddp_tp_two_ranks_bit_identical(disk_dir: Path) -> None:
    got = _launch(disk_dir)
    assert set(got) == {0, 1}, got
    for rank, result in got.items():
        assert result["world_size"] == 2
        assert result["leftover_files"] == []
        assert set(result["rows"]) == set(ROWS), result["rows"].keys()
        for name in ROWS:
            row = result["rows"][name]
            where = (rank, name, row)
            assert "error" not in row, where
            assert row["equal"] and row["mismatch"] == [], where
            assert row["offloaded_bytes"] > 0 and row["bytes_read"] > 0, where
            assert row["fallbacks"] == 0, where
            # The audit of every pack: only activations went to the mover, and the parameters
            # the ops saved (plain or DTensor) were seen and kept, so the check is not vacuous.
            audit: dict[str, int] = row["audit"]
            assert row["moved_non_activation"] == [], where
            moved = {k for k in audit if k.endswith("_moved")}
            assert moved == {"activation_moved"}, where
            params = "dtensor_parameter_kept" if name == "tp_sp" else "parameter_kept"
            assert audit.get(params, 0) > 0, where
            assert sum(audit.values()) == row["saved_tensors"], where
            # saved_bytes counts what the rank holds: a DTensor's local shard, not its global
            # size (the tp_sp row's sharded weights and sequence shards were counted twice).
            assert sum(row["audit_local_bytes"].values()) == row["saved_bytes"], where


def test_wrapper_subclass_counted_by_the_tensors_it_holds(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """A saved wrapper subclass is kept; its bytes in the stats are its inner tensors' (a
    DTensor's local shard; here both halves of a TwoTensor), not its outer ``nbytes``."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    t = TwoTensor(a, b).requires_grad_()
    assert t.nbytes == a.nbytes  # the outer size counts one half
    off = make_offloader(disk_dir, min_bytes=0)
    with off:
        u = (t * 2).sin()  # sin saves its input, a TwoTensor
    mid = off.stats()
    u.sum().backward()
    end = off.stats()
    off.close()
    assert mid.saved_tensors == 1 and mid.offloaded_bytes == 0
    assert mid.saved_bytes == mid.kept_bytes == a.nbytes + b.nbytes
    assert mid.resident_bytes == a.nbytes + b.nbytes
    assert end.resident_bytes == 0  # released by the same count
