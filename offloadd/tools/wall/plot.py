"""The wall figure: per strategy, throughput against the size it grew (batch or sequence), up to
its wall, the first size that did not train marked. matplotlib (the ``rok`` extra) is imported
only here, with the Agg backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offloadd.tools.wall.summary import points

__all__ = ["plot"]

_COLORS = {
    "plain": "tab:blue",
    "recompute": "tab:orange",
    "offload-ssd": "tab:green",
    "offload-cpu": "tab:purple",
    "auto": "tab:red",
    "sac": "tab:brown",
    "compile-budget": "tab:cyan",
}


def plot(rows: list[dict[str, Any]], grow: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "batch_size" if grow == "batch" else "seq_len"
    fig, ax = plt.subplots(figsize=(9, 5.2))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    aggregated = points(rows, key)  # a size measured in rounds: one point (summary.py)
    for s in strategies:
        color = _COLORS.get(s, "tab:gray")
        ok = sorted(
            (
                r[key],
                r["samples_per_s"],
                r["step_time_s"],
                r["step_time_min_s"],
                r["step_time_max_s"],
            )
            for (t, _), r in aggregated.items()
            if t == s
        )
        failed = [r[key] for r in rows if r["strategy"] == s and r["status"] != "ok"]
        if ok:
            xs = [p[0] for p in ok]
            ys = [p[1] for p in ok]
            # the spread of the timed steps: throughput at the slowest and the fastest step
            lo = [y - y * step / slow for _, y, step, _, slow in ok]
            hi = [y * step / fast - y for _, y, step, fast, _ in ok]
            ax.errorbar(
                xs, ys, yerr=[lo, hi], marker="o", color=color, capsize=3,
                label=f"{s} (wall: {xs[-1]})",
            )  # fmt: skip
        else:
            ax.plot([], [], color=color, label=f"{s} (trains no size tried)")
        # the first failed size above the wall (an earlier run's failure below it, as under
        # another budget, is not the wall)
        above = [f for f in failed if not ok or f > ok[-1][0]]
        if above:
            ax.axvline(min(above), color=color, linestyle=":", alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{'batch size' if grow == 'batch' else 'sequence length'} (log scale)")
    ax.set_ylabel("samples / s (bars: the timed steps' spread)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(title="strategy; dotted: first size out of memory", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
