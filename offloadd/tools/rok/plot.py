"""The ROK figure: throughput against activation memory, and step time against batch size.

matplotlib (the ``rok`` extra) is imported only here, with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["STYLE", "plot"]

STYLE = {
    "keep": ("tab:blue", "o"),
    "recompute": ("tab:orange", "s"),
    "offload-ssd": ("tab:green", "^"),
    "offload-cpu": ("tab:purple", "D"),
}

_MIB = 1 << 20


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Write the two-panel ROK figure of ``rows`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rok, steps) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    strategies = [s for s in STYLE if any(r["strategy"] == s for r in rows)]
    strategies += sorted({r["strategy"] for r in rows} - set(strategies))
    autos = [s for s in strategies if s.startswith("auto@")]
    for s in strategies:
        color: Any
        color, marker = STYLE.get(s, ("tab:gray", "x"))
        if s in autos:  # one shade of red per budget
            shade = 0.45 + 0.5 * autos.index(s) / max(1, len(autos) - 1)
            color, marker = plt.get_cmap("Reds")(shade), "*"
        ok = sorted(
            (r for r in rows if r["strategy"] == s and r["status"] == "ok"),
            key=lambda r: r["batch_size"],
        )
        mine = [r for r in rows if r["strategy"] == s]
        failed = sorted(r["batch_size"] for r in mine if r["status"] not in ("ok", "infeasible"))
        infeasible = sorted(r["batch_size"] for r in mine if r["status"] == "infeasible")
        label = s + (f" (OOM/failed at batch {', '.join(map(str, failed))})" if failed else "")
        if infeasible:  # auto: no plan fits the budget (not drawn: nothing ran)
            label += f" (no plan fits at batch {', '.join(map(str, infeasible))})"
        xs = [r["activation_peak_bytes"] / _MIB for r in ok]
        ys = [r["samples_per_s"] for r in ok]
        rok.plot(xs, ys, color=color, marker=marker, label=label)
        if any(r.get("rounds", 1) > 1 for r in ok):  # the spread over rounds
            lo = [y - r.get("samples_per_s_lo", y) for r, y in zip(ok, ys, strict=True)]
            hi = [r.get("samples_per_s_hi", y) - y for r, y in zip(ok, ys, strict=True)]
            rok.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor=color, alpha=0.5, capsize=3)
        for r, x, y in zip(ok, xs, ys, strict=True):
            rok.annotate(
                f"b={r['batch_size']}",
                (x, y),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=8,
                color=color,
            )
        steps.plot(
            [r["batch_size"] for r in ok],
            [r["step_time_s"] for r in ok],
            color=color,
            marker=marker,
            label=s,
        )
        if failed:
            top = max((r["step_time_s"] for r in rows if r["status"] == "ok"), default=1.0)
            steps.scatter(failed, [top] * len(failed), color=color, marker="x", s=60, zorder=3)
            for b in failed:
                steps.annotate(
                    "OOM",
                    (b, top),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                    color=color,
                )
    rok.set_xlabel("peak activation memory (MiB above the built model and optimizer)")
    rounds = max((r.get("rounds", 1) for r in rows), default=1)
    rok.set_ylabel(
        "throughput (samples/s)" + (f", median and range of {rounds} rounds" if rounds > 1 else "")
    )
    rok.set_title("ROK: recompute / offload / keep")
    rok.grid(alpha=0.3)
    rok.set_xlim(left=0)
    rok.set_ylim(bottom=0)
    rok.legend(fontsize=8)
    steps.set_xscale("log", base=2)
    batches = sorted({r["batch_size"] for r in rows})
    steps.set_xticks(batches, [str(b) for b in batches])
    steps.minorticks_off()
    rok.margins(x=0.08, y=0.08)
    steps.set_xlabel("batch size")
    steps.set_ylabel("median step time (s)")
    steps.set_title("step time")
    steps.grid(alpha=0.3)
    steps.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
