"""What environment activation prints and writes at exit: one stderr line and a JSON report."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
from typing import TYPE_CHECKING, Any

from offloadd.auto.plan_report import plan_summary
from offloadd.auto.solver import Plan
from offloadd.config import Config
from offloadd.integrations.ranks import RankInfo
from offloadd.runtime.stats import Stats
from offloadd.units import format_bytes

if TYPE_CHECKING:
    from offloadd.relay.surface import RelayStats

__all__ = ["report_dict", "summary_line", "write_report"]


def summary_line(
    stats: Stats,
    ranks: RankInfo,
    forwards: int,
    wall_s: float,
    relayed: tuple[RelayStats, ...] = (),
    plan: Plan | None = None,
) -> str:
    """``offloadd [rank r/n]: <N> forwards offloaded in <t>s; <Stats.summary()>``, the budget
    and its plan when one is set (``plan``: the last), and what relay moved (``relayed``: each
    relayed model's stats), if any."""
    who = f"offloadd [{ranks.label()}]" if ranks.multi else "offloadd"
    line = f"{who}: {forwards} forwards offloaded in {wall_s:.1f}s; {stats.summary()}" + (
        ", buffered I/O" if stats.buffered_io else ""
    )
    if plan is not None:
        line += f"; {plan_summary(plan)}"
    if relayed:
        line += (
            f"; relayed {format_bytes(sum(r.relayed_bytes for r in relayed))} of frozen "
            f"weights in {sum(r.groups for r in relayed)} groups, "
            f"peak held {format_bytes(sum(r.peak_resident_bytes for r in relayed))}, "
            f"read {format_bytes(sum(r.read_bytes for r in relayed))}, "
            f"read wait {sum(r.wait_s for r in relayed):.3f}s"
        )
    return line


def report_dict(
    *,
    stats: Stats,
    ranks: RankInfo,
    config: Config,
    forwards: int,
    wall_s: float,
    plan: dict[str, Any] | None = None,
    relayed: tuple[RelayStats, ...] = (),
) -> dict[str, Any]:
    return {
        "plan": plan,  # with a budget: the last plan (auto.plan_dict), else None
        "relay": [dataclasses.asdict(r) for r in relayed],  # each relayed model's
        "rank": ranks.rank,
        "world_size": ranks.world_size,
        "local_rank": ranks.local_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "forwards": forwards,
        "wall_s": wall_s,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.as_dict().items()},
        "stats": stats.as_dict(),
    }


def write_report(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` (a :func:`report_dict`) atomically: a reader never sees half a file."""
    target = os.path.expanduser(path)
    fd, tmp = tempfile.mkstemp(prefix=".offloadd-report-", dir=os.path.dirname(target) or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
