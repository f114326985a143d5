"""The corpus (the standard library's documentation, byte-level), the batches, and the training
runs: one per codec and control, with the gradient error against exact at the first step and at
the end."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field

import torch

from offloadd import Offloader
from offloadd.tools.models.gpt import GPT, GPTConfig

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
