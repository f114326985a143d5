"""The outputs of a run: the per-step losses (CSV), the loss curves (PNG) and the markdown page."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
from pathlib import Path

import torch

from .options import TARGETS
from .training import Corpus, Run, build_model

# -- output ------------------------------------------------------------------------------------


def smooth(values: list[float], k: int) -> list[float]:
    """Trailing median over ``k`` steps (fewer at the start): a single loss spike, which a
    moving average would carry for ``k`` steps and then drop at once, leaves it unmoved."""
    t = torch.tensor(values, dtype=torch.float64)
    return [float(t[max(0, i + 1 - k) : i + 1].median()) for i in range(len(values))]


def write_csv(path: Path, runs: list[Run]) -> None:
    lines = ["step," + ",".join(r.label for r in runs)]
    for i in range(len(runs[0].losses)):
        lines.append(f"{i + 1}," + ",".join(f"{r.losses[i]:.6f}" for r in runs))
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, runs: list[Run], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(1, min(25, args.steps // 10))
    base = smooth(runs[0].losses, k)
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(14, 5.5))
    steps = range(1, args.steps + 1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(runs):
        color = "black" if r.label == "none" else colors[i % len(colors)]
        style = "-" if r.main else "--"
        s = smooth(r.losses, k)
        ax.plot(steps, r.losses, color=color, alpha=0.15, linewidth=0.7)
        ax.plot(steps, s, color=color, linestyle=style, linewidth=1.4, label=r.label)
        if r is not runs[0]:
            rel = [100 * (a / b - 1) for a, b in zip(s, base, strict=True)]
            gap.plot(steps, rel, color=color, linestyle=style, linewidth=1.2, label=r.label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (bytes, nats)")
    ax.set_title(f"loss: raw (faint) and {k}-step trailing median")
    lo = min(min(smooth(r.losses, k)[args.steps // 3 :]) for r in runs)
    ax.set_ylim(lo * 0.95, runs[0].losses[0] * 1.05)
    ax.legend()
    ax.grid(alpha=0.3)
    for bound, ls in ((1, ":"), (3, "-.")):
        for sign in (1, -1):
            gap.axhline(sign * bound, color="grey", linestyle=ls, linewidth=0.8)
    gap.axhline(0, color="black", linewidth=0.8)
    gap.set_xlabel("step")
    gap.set_ylabel(f"{k}-step median loss vs none's (%)")
    gap.set_title("gap to none (dotted: ±1 %, dash-dot: ±3 %)")
    gap.set_xlim(args.steps * 0.2, args.steps)
    gap.legend()
    gap.grid(alpha=0.3)
    fig.suptitle(
        f"GPT {args.layers}x{args.d_model}, seq {args.seq}, batch {args.batch}, "
        f"byte-level pydoc_data.topics, tier {args.tier}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def sci(x: float) -> str:
    return f"{x:.2e}" if math.isfinite(x) else "-"


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores{mem}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); {platform.platform()}; "
        f"python {platform.python_version()}"
    )


def verdict(codec: str, ratio: float) -> str:
    target = TARGETS.get(codec)
    if codec == "none":
        return "baseline"
    if target is None:
        return "reported only"
    return "pass" if abs(ratio - 1) <= target else "FAIL"


def write_markdown(
    path: Path,
    runs: list[Run],
    corpus: Corpus,
    args: argparse.Namespace,
    argv: list[str],
    started: datetime.datetime,
    total_s: float,
    skipped: list[str],
) -> None:
    w = args.window
    base = runs[0]
    main_runs = [r for r in runs if r.main]
    extra = [r for r in runs if not r.main]
    n_params = sum(p.numel() for p in build_model(args, args.seed).parameters())
    finished = datetime.datetime.now(datetime.UTC)
    cmd = " ".join(
        shlex.quote(a) for a in [".venv/bin/python", "-m", "scripts.codec_convergence", *argv]
    )
    out = [
        f"# Codec convergence: byte-level GPT on CPU ({os.cpu_count()} cores)",
        "",
        f"- finished: {finished:%Y-%m-%dT%H:%M:%SZ} (started {started:%H:%M:%SZ}, "
        f"{total_s:.0f} s in all)",
        f"- machine: {machine_line()}",
        f"- command: `{cmd}`",
        f"- codec code: {args.provenance}",
        f"- corpus: {corpus.source}: {corpus.topics} topics of the Python reference "
        f"documentation, UTF-8 bytes (vocabulary 256), {len(corpus.train):,} bytes to train on, "
        f"the last {len(corpus.held_out):,} held out (10 %, after the training bytes in sorted "
        f"topic order)",
        f"- model: built-in GPT, {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"seq {args.seq}, dropout {args.dropout}, {n_params / 1e6:.2f} M parameters (tied head)",
        f"- training: {args.steps} steps of batch {args.batch} (random windows, drawn up front "
        f"from the seed: {args.steps * args.batch * args.seq / len(corpus.train):.2f} passes "
        f"over the training bytes), AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), "
        f"peak lr {args.lr:g}, {args.warmup} warm-up steps then cosine to a tenth, gradient "
        f"norm clipped at 1",
        f"- offloader: `Offloader(tier={args.tier!r}, codec=..., "
        f"codec_min_bytes={args.codec_min_bytes})` around forward, backward outside; the other "
        f"codec settings at their defaults (group 256, symmetric int8, round to nearest, the "
        f"default op list of codec/allowlist.py)",
        f"- every codec run (seed {args.seed}) starts from the same weights and sees the same batches in "
        f"the same order; nothing in training draws random numbers after the initialisation "
        f"(dropout {args.dropout}), so the runs differ by the codec alone",
        f"- held-out loss: mean cross-entropy over {args.eval_batches * args.batch} evenly spaced "
        f"windows of the held-out bytes, after the last step, without an Offloader",
        "",
        f"![loss curves]({args.name}.png)",
        "",
        f"Final loss: the mean training loss of the last {w} steps. Ratio: final loss over "
        f"none's. Target: |ratio - 1| at most 1 % for int8 and fp8, 3 % for int4; int2 is "
        f"reported only. Gradient error: |g - g_exact| / |g_exact| (g_exact without any "
        f"Offloader), at step 1 (initial weights, first batch) and at the end (the run's "
        f"final weights, mean over 4 held-out batches, tier keep).",
        "",
        "| codec | final loss | ratio to none | held-out loss | held-out ratio | target | "
        "verdict | gradient error (step 1 / end) | saved for backward per step | vs none | "
        "coded per step (in -> out) | median step (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    steps = args.steps
    for r in main_runs:
        ratio = r.final(w) / base.final(w)
        held = r.held_out / base.held_out
        target = TARGETS.get(r.codec)
        coded = (
            f"{fmt_bytes(r.coded_in_bytes / steps)} -> {fmt_bytes(r.coded_out_bytes / steps)}"
            if r.codec != "none"
            else "-"
        )
        out.append(
            f"| {r.codec} | {r.final(w):.4f} | {ratio:.4f} ({100 * (ratio - 1):+.2f} %) | "
            f"{r.held_out:.4f} | {held:.4f} ({100 * (held - 1):+.2f} %) | "
            f"{'±' + format(100 * target, 'g') + ' %' if target else '-'} | "
            f"{verdict(r.codec, ratio)} | "
            f"{r.grad_rel_err:.2e} / {sci(r.grad_rel_err_end)} | "
            f"{fmt_bytes(r.saved_bytes / steps)} | "
            f"{r.saved_bytes / base.saved_bytes:.3f}x | {coded} | "
            f"{sorted(r.step_s)[len(r.step_s) // 2]:.3f} |"
        )
    if extra:
        out += [
            "",
            f"Control runs of none, against none at seed {args.seed}: `@seedN` draws other initial "
            f"weights and another batch order; `~perturbK` is seed {args.seed} (same batches) with "
            f"every initial weight multiplied by 1 + {args.perturb_eps:g} * N(0, 1) (draw K), a "
            f"change far below any codec's error, so its gap is the drift that any tiny "
            f"difference grows into over {args.steps} steps; `~noiseK` is seed {args.seed} with "
            f"every gradient, at every step, plus {args.noise_eps:g} times its RMS times "
            f"N(0, 1) (stream K): an error as large as a codec's or larger, but unbiased, so "
            f"its gap is what error of that size costs when it averages out:",
            "",
            "| run | final loss | ratio to none | held-out loss | held-out ratio | "
            "gradient error (step 1) |",
            "|---|---|---|---|---|---|",
        ]
        for r in extra:
            ratio = r.final(w) / base.final(w)
            held = r.held_out / base.held_out
            grad = f"{r.grad_rel_err:.2e}" if math.isfinite(r.grad_rel_err) else "-"
            out.append(
                f"| {r.label} | {r.final(w):.4f} | {ratio:.4f} ({100 * (ratio - 1):+.2f} %) | "
                f"{r.held_out:.4f} | {held:.4f} ({100 * (held - 1):+.2f} %) | {grad} |"
            )
        same_seed = [abs(r.final(w) / base.final(w) - 1) for r in extra if r.control]
        if same_seed:
            out += [
                "",
                f"Largest final-loss gap of a same-seed control run: "
                f"{100 * max(same_seed):.2f} % (over {len(same_seed)}).",
            ]
    out += [
        "",
        "Per-step loss of every run: "
        f"[{args.name}.csv]({args.name}.csv). Bytes: `saved for backward` is the Offloader's "
        "`saved_bytes` over the run divided by the steps: every tensor autograd saved, "
        "weights included, views of one storage counted each time; for a codec, the codes "
        "and ranges of what it encoded in place of those tensors, plus what it left exact; "
        "`coded` is `coded_in_bytes` and `coded_out_bytes` per step (the activations the codec "
        "encoded, and their codes and ranges).",
        "",
        "Peak bytes of saved activations held at once (`peak_resident_bytes`, every saved "
        "tensor, each storage once; tier keep holds them all until backward):",
        "",
        "| codec | peak resident | vs none | tensors coded per step | run wall time (s) |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        out.append(
            f"| {r.label} | {fmt_bytes(r.peak_resident_bytes)} | "
            f"{r.peak_resident_bytes / base.peak_resident_bytes:.3f}x | "
            f"{r.coded_tensors / steps:.0f} | {r.wall_s:.0f} |"
        )
    notes = list(args.note)
    if skipped:
        notes.append(f"skipped for time (--max-minutes {args.max_minutes:g}): {', '.join(skipped)}")
    if notes:
        out += ["", "Notes:", ""]
        out += [f"- {n}" for n in notes]
    path.write_text("\n".join(out) + "\n")
