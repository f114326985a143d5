#!/usr/bin/env python3
"""Convergence of a small GPT trained with each lossy activation codec, against exact (none).

The built-in GPT (offloadd.tools.models.gpt) is trained byte-level (vocabulary 256) on a real
English corpus available offline: the Python reference documentation shipped with the standard
library (``pydoc_data.topics``), topics in sorted order, the first 90 % of the bytes for training
and the last 10 % held out. Every run starts from the same initial weights and sees the same
batches in the same order; only the codec of the :class:`~offloadd.Offloader` around forward
differs (``none``: the same Offloader, activations saved exactly). Written to ``--out``:

* ``NAME.csv``: the training loss of every run, one row per step;
* ``NAME.png``: loss curves (raw faint, smoothed solid) and the smoothed gap to none in percent;
* ``NAME.md``: command, machine, per codec the final loss (mean of the last 50 steps), its ratio
  to none's, the held-out loss, the target (1 % int8 and fp8, 3 % int4, int2 reported only),
  pass or fail, the bytes saved for backward per step, step time, and the spread of none itself
  in control runs (``--perturb-runs``: initial weights perturbed by a relative 1e-6;
  ``--noise-runs``: unbiased noise of 1 % added to every gradient, larger than an 8-bit codec's
  error; ``--extra-seeds``: other weights and batch order), which says whether a gap is signal;
  and each codec's gradient error at the first step and on its final weights.

    python scripts/codec_convergence.py --quick --out /tmp/cc          # smoke run, ~1 minute
    python scripts/codec_convergence.py --out docs/benchmarks           # the full run
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offloadd import Offloader
from offloadd.codec import CODECS
from offloadd.tools.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
TARGETS: dict[str, float] = {"int8": 0.01, "fp8-e4m3": 0.01, "fp8-e5m2": 0.01, "int4": 0.03}
"""The accepted bound on |final loss / none's - 1|; codecs not listed (int2) are reported only."""


# -- arguments ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--codecs",
        default="none,int8,fp8-e4m3,fp8-e5m2,int4,int2",
        help="comma-separated codecs; none is always run (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 300)")
    p.add_argument("--seed", type=int, default=0, help="init and batch-order seed (default: 0)")
    p.add_argument(
        "--extra-seeds",
        default="",
        help="comma-separated further seeds for none alone: its run-to-run spread (default: none)",
    )
    p.add_argument(
        "--perturb-runs",
        type=int,
        default=0,
        help="further runs of none, same seed, initial weights times (1 + eps * N(0, 1)), "
        "a different draw each (default: 0)",
    )
    p.add_argument("--perturb-eps", type=float, default=1e-6, help="(default: %(default)g)")
    p.add_argument(
        "--noise-runs",
        type=int,
        default=0,
        help="further runs of none, same seed, each gradient plus eps * its RMS * N(0, 1) at "
        "every step, a different stream each (default: 0)",
    )
    p.add_argument("--noise-eps", type=float, default=1e-2, help="(default: %(default)g)")
    p.add_argument("--tier", choices=("keep", "cpu", "ssd"), default="keep")
    p.add_argument("--ssd-dir", type=Path, default=None, help="offload directory (tier ssd)")
    p.add_argument(
        "--codec-min-bytes",
        type=int,
        default=64 << 10,
        help="codec.min_bytes (default: %(default)s, the config's default)",
    )
    p.add_argument("--layers", type=int, default=None, help="default: 4 (quick: 2)")
    p.add_argument("--d-model", type=int, default=None, help="default: 256 (quick: 64)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=None, help="default: 128 (quick: 64)")
    p.add_argument("--batch", type=int, default=None, help="default: 16 (quick: 4)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps/15)")
    p.add_argument("--window", type=int, default=50, help="final loss: mean of the last N steps")
    p.add_argument("--eval-batches", type=int, default=None, help="held-out batches (default 32)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="skip the control runs (--perturb-runs, --noise-runs, --extra-seeds) that would "
        "end past this "
        "many minutes (0: never)",
    )
    p.add_argument("--print-every", type=int, default=None, help="progress every N steps")
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default: docs/benchmarks)"
    )
    p.add_argument(
        "--name", default=None, help="file stem (default: codec_convergence_<machine>_<date>)"
    )
    p.add_argument("--note", action="append", default=[], help="a note for the markdown (repeat)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 20 steps")
    args = p.parse_args(argv)

    quick = args.quick
    defaults = {
        "steps": 20 if quick else 300,
        "layers": 2 if quick else 4,
        "d_model": 64 if quick else 256,
        "seq": 64 if quick else 128,
        "batch": 4 if quick else 16,
        "eval_batches": 4 if quick else 32,
        "print_every": 5 if quick else 25,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup is None:
        args.warmup = max(1, args.steps // 15)
    args.window = min(args.window, max(1, args.steps // 2))
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    for c in codecs:
        if c not in CODECS:
            p.error(f"--codecs: {c!r} is not one of {', '.join(CODECS)}")
    args.codecs = ["none", *[c for c in dict.fromkeys(codecs) if c != "none"]]
    args.extra_seeds = [int(s) for s in args.extra_seeds.split(",") if s.strip()]
    if args.tier == "ssd" and args.ssd_dir is None:
        p.error("--tier ssd needs --ssd-dir")
    if args.out is None:
        args.out = Path("/tmp/codec_convergence") if quick else ROOT / "docs" / "benchmarks"
    if args.name is None:
        day = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        args.name = f"codec_convergence_{machine_tag()}_{day}"
    return args


def codec_provenance() -> str:
    """Which codec code this process runs: the compiled kernels or the torch ops, and a short
    hash of each source and extension file of offloadd/codec as imported."""
    import hashlib

    import offloadd.codec.quant as quant

    native = getattr(quant, "native_available", lambda: False)()
    folder = Path(quant.__file__).parent
    files = sorted(
        [*folder.glob("*.py"), *folder.glob("*.so")], key=lambda f: (f.suffix != ".py", f.name)
    )
    digests = ", ".join(
        f"{f.name} {hashlib.sha256(f.read_bytes()).hexdigest()[:12]}" for f in files
    )
    path = (
        "compiled kernels (csrc/codec/codec.c) for host integer and fp8 codes"
        if native
        else "torch ops"
    )
    return f"{path}; sha256 at start: {digests}"


def machine_tag() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).split()[-1].lower()
    return f"cpu-{os.cpu_count()}core"


# -- data --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Corpus:
    train: torch.Tensor
    held_out: torch.Tensor
    source: str
    topics: int


def load_corpus() -> Corpus:
    """The Python reference documentation shipped with the standard library, as UTF-8 bytes:
    topics in sorted order, the first 90 % for training, the rest held out."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    cut = int(len(data) * 0.9)
    return Corpus(
        train=data[:cut],
        held_out=data[cut:],
        source=f"pydoc_data.topics ({pydoc_data.topics.__file__})",
        topics=len(topics),
    )


def batch_starts(n: int, seq: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """The random windows of every training step, drawn up front: (steps, batch)."""
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    return torch.randint(0, n - seq - 1, (steps, batch), generator=gen)


def windows(
    data: torch.Tensor, starts: torch.Tensor, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def eval_starts(n: int, seq: int, count: int) -> torch.Tensor:
    """Evenly spaced windows over the held-out bytes (the same for every run)."""
    return torch.linspace(0, n - seq - 2, count).long()


# -- training ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    codec: str
    seed: int
    control: str = ""
    """"" for a codec run, else "perturbK" or "noiseK" (a control run of none)."""
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    held_out: float = math.nan
    saved_bytes: int = 0
    peak_resident_bytes: int = 0
    coded_in_bytes: int = 0
    coded_out_bytes: int = 0
    coded_tensors: int = 0
    grad_rel_err: float = math.nan
    grad_rel_err_end: float = math.nan
    wall_s: float = 0.0

    @property
    def label(self) -> str:
        seed = "" if self.seed == SEED0 else f"@seed{self.seed}"
        return f"{self.codec}{seed}" + (f"~{self.control}" if self.control else "")

    @property
    def main(self) -> bool:
        """A run of the codec comparison (not a control run of none)."""
        return self.seed == SEED0 and not self.control

    def final(self, window: int) -> float:
        return sum(self.losses[-window:]) / len(self.losses[-window:])


SEED0 = 0  # set from --seed in main()


def build_model(args: argparse.Namespace, seed: int) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=256,
        seq_len=args.seq,
        num_layers=args.layers,
        d_model=args.d_model,
        num_heads=args.heads,
        dropout=args.dropout,
    )
    return GPT(cfg)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def reference_grad(args: argparse.Namespace, corpus: Corpus, starts: torch.Tensor) -> torch.Tensor:
    """The exact gradient at the initial weights on the first batch, without any Offloader."""
    model = build_model(args, SEED0)
    x, y = windows(corpus.train, starts[0], args.seq)
    model(x, y).backward()
    return flat_grad(model)


def train(
    args: argparse.Namespace,
    corpus: Corpus,
    codec: str,
    seed: int,
    starts: torch.Tensor,
    ref_grad: torch.Tensor | None,
    control: str = "",
) -> Run:
    run = Run(codec=codec, seed=seed, control=control)
    model = build_model(args, seed)
    draw = int(control.removeprefix("perturb").removeprefix("noise") or 0)
    noise_gen = torch.Generator().manual_seed(draw) if control.startswith("noise") else None
    if control.startswith("perturb"):
        gen = torch.Generator().manual_seed(draw)
        with torch.no_grad():
            for p in model.parameters():
                noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
                p.mul_(1 + args.perturb_eps * noise)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    ssd_dirs = (str(args.ssd_dir),) if args.ssd_dir is not None else ()
    off = Offloader(
        tier=args.tier,
        ssd_dirs=ssd_dirs,
        codec={"name": codec, "min_bytes": args.codec_min_bytes},
    )
    t_run = time.perf_counter()
    try:
        for step in range(args.steps):
            x, y = windows(corpus.train, starts[step], args.seq)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            t0 = time.perf_counter()
            with off:
                loss = model(x, y)
            loss.backward()
            if noise_gen is not None:
                add_grad_noise(model, args.noise_eps, noise_gen)
            if step == 0 and ref_grad is not None:
                g = flat_grad(model)
                run.grad_rel_err = float((g - ref_grad).norm() / ref_grad.norm())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.step_s.append(time.perf_counter() - t0)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise RuntimeError(f"{run.label}: loss {value} at step {step}")
            run.losses.append(value)
            if (step + 1) % args.print_every == 0 or step + 1 == args.steps:
                recent = run.losses[-args.print_every :]
                print(
                    f"  [{run.label:>18}] step {step + 1:4d}/{args.steps} "
                    f"loss {sum(recent) / len(recent):.4f} "
                    f"({sum(run.step_s[-args.print_every :]) / len(recent):.3f} s/step, "
                    f"{time.perf_counter() - t_run:.0f} s)",
                    flush=True,
                )
        st = off.stats()
    finally:
        off.close()
    run.wall_s = time.perf_counter() - t_run
    run.saved_bytes = st.saved_bytes
    run.peak_resident_bytes = st.peak_resident_bytes
    run.coded_in_bytes = st.coded_in_bytes
    run.coded_out_bytes = st.coded_out_bytes
    run.coded_tensors = st.coded_tensors
    run.held_out = evaluate(model, corpus, args)
    if run.main and codec != "none":
        run.grad_rel_err_end = grad_error(model, codec, corpus, args)
    return run


def add_grad_noise(model: torch.nn.Module, eps: float, gen: torch.Generator) -> None:
    """Unbiased noise: each gradient plus ``eps`` times its RMS times N(0, 1)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                rms = p.grad.norm() / math.sqrt(p.grad.numel())
                p.grad.add_(torch.randn(p.grad.shape, generator=gen) * (eps * rms))


def grad_error(model: GPT, codec: str, corpus: Corpus, args: argparse.Namespace) -> float:
    """|g_codec - g_exact| / |g_exact| on the model's present weights, over a few held-out
    batches (the gradients are computed and dropped; the weights are not changed)."""
    starts = eval_starts(len(corpus.held_out), args.seq, 4 * args.batch)
    errors = []
    for chunk in starts.split(args.batch):
        x, y = windows(corpus.held_out, chunk, args.seq)
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        exact = flat_grad(model)
        model.zero_grad(set_to_none=True)
        off = Offloader(tier="keep", codec={"name": codec, "min_bytes": args.codec_min_bytes})
        try:
            with off:
                loss = model(x, y)
            loss.backward()
        finally:
            off.close()
        errors.append(float((flat_grad(model) - exact).norm() / exact.norm()))
    model.zero_grad(set_to_none=True)
    return sum(errors) / len(errors)


@torch.no_grad()
def evaluate(model: GPT, corpus: Corpus, args: argparse.Namespace) -> float:
    model.eval()
    starts = eval_starts(len(corpus.held_out), args.seq, args.eval_batches * args.batch)
    total = 0.0
    for chunk in starts.split(args.batch):
        x, y = windows(corpus.held_out, chunk, args.seq)
        total += float(model(x, y)) * len(chunk)
    model.train()
    return total / len(starts)


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
    n_params = sum(p.numel() for p in build_model(args, SEED0).parameters())
    finished = datetime.datetime.now(datetime.UTC)
    cmd = " ".join(
        shlex.quote(a) for a in [".venv/bin/python", "scripts/codec_convergence.py", *argv]
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
        f"- every codec run (seed {SEED0}) starts from the same weights and sees the same batches in "
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
            f"Control runs of none, against none at seed {SEED0}: `@seedN` draws other initial "
            f"weights and another batch order; `~perturbK` is seed {SEED0} (same batches) with "
            f"every initial weight multiplied by 1 + {args.perturb_eps:g} * N(0, 1) (draw K), a "
            f"change far below any codec's error, so its gap is the drift that any tiny "
            f"difference grows into over {args.steps} steps; `~noiseK` is seed {SEED0} with "
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


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global SEED0
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.provenance = codec_provenance()
    SEED0 = args.seed
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.datetime.now(datetime.UTC)
    t_all = time.perf_counter()
    corpus = load_corpus()
    print(
        f"corpus: {len(corpus.train):,} training bytes, {len(corpus.held_out):,} held out; "
        f"model {args.layers}x{args.d_model}, seq {args.seq}, batch {args.batch}, "
        f"{args.steps} steps; codecs {', '.join(args.codecs)}; tier {args.tier}; "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    n = len(corpus.train)
    starts = batch_starts(n, args.seq, args.batch, args.steps, args.seed)
    ref = reference_grad(args, corpus, starts)
    runs: list[Run] = []
    plan = (
        [(c, args.seed, "") for c in args.codecs]
        + [("none", args.seed, f"perturb{k}") for k in range(1, args.perturb_runs + 1)]
        + [("none", args.seed, f"noise{k}") for k in range(1, args.noise_runs + 1)]
        + [("none", s, "") for s in args.extra_seeds]
    )
    skipped: list[str] = []
    for codec, seed, control in plan:
        elapsed = time.perf_counter() - t_all
        if (seed != args.seed or control) and args.max_minutes and runs:
            per_run = max(r.wall_s for r in runs)
            if elapsed + per_run > 60 * args.max_minutes:
                label = Run(codec, seed, control).label
                skipped.append(label)
                print(f"skipping {label}: {elapsed:.0f} s + {per_run:.0f} s per run")
                continue
        s = starts if seed == args.seed else batch_starts(n, args.seq, args.batch, args.steps, seed)
        run = train(args, corpus, codec, seed, s, ref if seed == args.seed else None, control)
        runs.append(run)
        base = runs[0]
        print(
            f"{run.label}: final {run.final(args.window):.4f} "
            f"(x{run.final(args.window) / base.final(args.window):.4f} of none), "
            f"held-out {run.held_out:.4f}, grad error {run.grad_rel_err:.2e} "
            f"(end {run.grad_rel_err_end:.2e}), "
            f"{run.wall_s:.0f} s",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name
    write_csv(stem.with_suffix(".csv"), runs)
    plot(stem.with_suffix(".png"), runs, args)
    total = time.perf_counter() - t_all
    write_markdown(stem.with_suffix(".md"), runs, corpus, args, argv, started, total, skipped)
    print(f"wrote {stem}.md, .csv, .png ({total:.0f} s)")
    base = runs[0]
    failed = [
        r.codec
        for r in runs
        if r.main and verdict(r.codec, r.final(args.window) / base.final(args.window)) == "FAIL"
    ]
    if failed:
        print(f"outside the target: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
