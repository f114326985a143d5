"""Arms in processes of their own: a fresh or a warm inductor cache, ``OFFLOADD=1``, torchrun.

``arm(spec, ...)`` runs one arm as ``python -m tests._support.seams.worker`` (two ranks under
torchrun where asked) and returns its traces, one per rank; ``env`` adds ``OFFLOADD=1`` and the
variables of the cell's features, and the exit report's stats come back as the trace's ``did``.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests._support import envrun
from tests._support.seams.arm import ArmSpec
from tests._support.seams.cells import Cell

__all__ = ["arm", "env_of", "fresh_cache"]

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 600


def fresh_cache(root: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix="inductor-", dir=root))


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def env_of(cell: Cell, spec: ArmSpec, report: str) -> dict[str, str]:
    """``OFFLOADD=1`` with the grid's sizes, and the cell's other features as variables."""
    env = {
        "OFFLOADD": "1",
        "OFFLOADD_SSD_DIRS": spec.dirs,
        "OFFLOADD_MIN_BYTES": "4096",
        "OFFLOADD_CHUNK_BYTES": "64KiB",
        "OFFLOADD_STAGING_BYTES": "1MiB",
        "OFFLOADD_PREFETCH_BYTES": "512KiB",
        "OFFLOADD_IO_THREADS": "2",
        "OFFLOADD_REPORT": report,
    }
    for name in cell.features:
        for key, value in (cell.feature(name).env or {}).items():
            env[key] = value.format(socket=spec.socket)
    return env


def arm(
    spec: ArmSpec,
    *,
    cache: Path,
    ranks: int = 0,
    env: dict[str, str] | None = None,
    report: str = "",
) -> list[dict[str, Any]]:
    """Run ``spec`` in its own process (``ranks`` > 0: that many under torchrun) with the
    inductor cache ``cache``; its traces in rank order ({"refused": ...} for a refusal).
    ``report``: the exit report's path (``{rank}`` in it: each rank's), whose stats and relay
    figures join each trace's ``did``."""
    out = Path(tempfile.mkdtemp(prefix="seams-out-", dir=spec.dirs))
    extra = {
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": _free_port(),
        **(env or {}),
    }
    base = envrun.clean_env(**extra)
    worker = ["-m", "tests._support.seams.worker", json.dumps(spec.to_json())]
    target = str(out / "trace-{rank}.pt")
    if ranks:
        cmd = [
            str(envrun.BIN / "torchrun"),
            f"--nproc-per-node={ranks}",
            f"--master-port={extra['MASTER_PORT']}",
            *worker,
            target,
        ]
    else:
        cmd = [sys.executable, *worker, target]
    try:
        envrun.run(cmd, base, timeout=TIMEOUT_S, cwd=ROOT)
        traces = [
            torch.load(out / f"trace-{r}.pt", weights_only=False) for r in range(max(ranks, 1))
        ]
    finally:
        shutil.rmtree(out)
    for r, trace in enumerate(traces):
        path = Path(report.format(rank=r)) if report else None
        if path is None or not path.exists() or "refused" in trace:
            continue
        doc = json.loads(path.read_text())
        relayed = sum(x["read_bytes"] for x in doc["relay"])
        planned = int(doc["plan"] is not None)
        trace["did"] = {
            **trace["did"],
            **doc["stats"],
            "relay_read_bytes": relayed,
            "planned": planned,
        }
        path.unlink()
    return traces
