"""The sweep of ``offloadd rok``: what it measures, checked and completed from its options.

A :class:`Sweep` is one model shape on one device, run at every (strategy, batch size), in
``repeats`` rounds. :func:`resolve` builds it from the options of ``offloadd rok`` (see
``offloadd.tools.rok.command.add_arguments``) and raises :class:`UsageError`, naming the option, before
any point runs.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offloadd.cli_dirs import ready_dir
from offloadd.config import CodecConfig, Config, parse_size
from offloadd.io.files import default_offload_dir
from offloadd.tools.harness.step_trace import cpu_allocator
from offloadd.tools.harness.train import split_label
from offloadd.tools.models.build import default_vocab
from offloadd.tools.models.hf import HF_FAMILIES

__all__ = [
    "AUTO",
    "KEY",
    "RECOMPUTE_BUDGET",
    "STRATEGIES",
    "Sweep",
    "UsageError",
    "resolve",
    "run_strategy",
]

STRATEGIES = {
    "keep": "keep",
    "recompute": "recompute",
    "offload-ssd": "ssd",
    "offload-cpu": "cpu",
    "auto": "auto",
}
"""``--strategies`` names -> ``RunSpec.strategy``. keep runs offloadd's hooks with the keep tier
(nothing moves, but its resident-byte accounting is there to compare). ``auto`` becomes one
strategy per ``--budgets`` entry, ``auto@<budget>``."""

AUTO = "auto@"
RECOMPUTE_BUDGET = "recompute"
"""The ``--budgets`` entry that means recompute's measured activation peak at the same batch
size and round (a budget equal to full recompute's peak)."""


def run_strategy(label: str) -> str:
    """The ``RunSpec.strategy`` of a strategy label (``auto@0.3x`` -> ``auto``; a codec after a
    plus, ``offload-ssd+int8``, does not change it)."""
    label = split_label(label, "")[0]
    return "auto" if label.startswith(AUTO) else STRATEGIES[label]


def _budgets(text: str) -> list[str]:
    out = []
    for t in (x.strip() for x in text.split(",")):
        if not t:
            continue
        if t != RECOMPUTE_BUDGET:
            try:
                Config().replace(budget=t)
            except ValueError as e:
                raise UsageError(f"--budgets: {e}") from None
        out.append(t)
    if not out:
        raise UsageError(f"--budgets must list at least one budget, got {text!r}")
    return list(dict.fromkeys(out))


KEY = (
    "model",
    "layers",
    "hidden",
    "heads",
    "seq",
    "vocab",
    "device",
    "steps",
    "warmup",
    "codec",
    "compile",
)
"""The fields that tell sweeps apart; ``--resume`` continues only a rok.csv whose rows match."""

_SIZES: dict[str, dict[str, int]] = {
    "full": {"layers": 12, "hidden": 768, "heads": 12, "seq": 512, "steps": 8, "warmup": 3},
    "quick": {"layers": 4, "hidden": 256, "heads": 4, "seq": 256, "steps": 2, "warmup": 1},
}
_BATCH_SIZES = {"full": "1,2,4,8", "quick": "1,2,4"}


class UsageError(ValueError):
    """A bad argument, reported before any point runs."""


@dataclass(kw_only=True)
class Sweep:
    """One sweep, every option checked and every default filled in."""

    model: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch_sizes: list[int]
    strategies: list[str]
    device: str
    allocator: str
    """torch's CPU allocator of every point: the host cache on CPU (ssd's there), else auto."""
    steps: int
    warmup: int
    codec: str
    compile: bool
    repeats: int
    out: Path
    ssd_dir: str | None
    offload_dir: str | None
    memory_limit: int
    point_timeout: float | None
    resume: bool
    plot: bool

    def key(self) -> dict[str, Any]:
        """The ``KEY`` fields and their values, which every row of this sweep starts with."""
        return {k: getattr(self, k) for k in KEY}

    def points(self) -> Iterator[tuple[int, int, str]]:
        """(round, batch size, strategy): round by round, batch size by batch size, every
        strategy in turn, so that drift and other load hit all strategies alike."""
        for n in range(1, self.repeats + 1):
            for b in self.batch_sizes:
                for s in self.strategies:
                    yield n, b, s

    def title(self) -> str:
        return (
            f"{self.model}: {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
            f"seq {self.seq}, vocab {self.vocab}; {self.steps} timed steps after {self.warmup} "
            f"warm-ups on {self.device}"
            + (f"; codec {self.codec}" if self.codec != "none" else "")
            + ("; compiled whole (torch.compile)" if self.compile else "")
        )


def _int_list(text: str, option: str) -> list[int]:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise UsageError(f"{option} must list at least one batch size, got {text!r}")
    try:
        values = [int(t) for t in parts]
    except ValueError:
        raise UsageError(f"{option} must be comma-separated integers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise UsageError(f"{option} must be positive, got {text!r}")
    return sorted(set(values))


def resolve(ns: argparse.Namespace) -> Sweep:
    """Check every argument and fill in defaults; UsageError names the bad option."""
    kind = "quick" if ns.quick else "full"
    size = _SIZES[kind]
    if ns.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif ns.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device")
    else:
        device = ns.device
    layers = ns.layers if ns.layers is not None else size["layers"]
    hidden = ns.hidden if ns.hidden is not None else size["hidden"]
    heads = ns.heads if ns.heads is not None else size["heads"]
    seq = ns.seq if ns.seq is not None else size["seq"]
    steps = ns.steps if ns.steps is not None else size["steps"]
    warmup = ns.warmup if ns.warmup is not None else size["warmup"]
    if warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {warmup}")
    for name, value in (
        ("--layers", layers),
        ("--hidden", hidden),
        ("--heads", heads),
        ("--seq", seq),
        ("--steps", steps),
        ("--repeats", ns.repeats),
    ):
        if value <= 0:
            raise UsageError(f"{name} must be positive, got {value}")
    if hidden % heads:
        raise UsageError(f"--heads ({heads}) must divide --hidden ({hidden})")
    if ns.vocab is not None and ns.vocab < 2:
        raise UsageError(f"--vocab must be at least 2, got {ns.vocab}")
    batch_sizes = _int_list(
        ns.batch_sizes if ns.batch_sizes is not None else _BATCH_SIZES[kind],
        "--batch-sizes",
    )
    if ns.strategies is None:
        strategies = ["keep", "recompute", "offload-ssd"]
        if device == "cuda":
            strategies.append("offload-cpu")
    else:
        strategies = [s.strip() for s in ns.strategies.split(",") if s.strip()]
        if not strategies:
            raise UsageError(f"--strategies must name at least one strategy, got {ns.strategies!r}")
        unknown = [
            s
            for s in strategies
            if ":" in s or (split_label(s, "")[0] not in STRATEGIES and not s.startswith(AUTO))
        ]
        if unknown:
            raise UsageError(
                f"--strategies: unknown strategy {unknown[0]!r} "
                f"(choose from {', '.join(STRATEGIES)}; keep and offload ones may name a codec "
                "after a plus, offload-ssd+int8; every point runs on the same allocator)"
            )
        for s in strategies:
            base, named, _ = split_label(s, "")
            if named and base in ("recompute", "auto"):
                raise UsageError(
                    f"--strategies {s!r}: a codec after a plus is for keep and offload "
                    "strategies (auto takes --codec; recompute saves nothing to code)"
                )
            if named:
                try:
                    CodecConfig(name=named)  # type: ignore[arg-type]
                except ValueError as e:
                    raise UsageError(f"--strategies {s!r}: {e}") from None
        strategies = list(dict.fromkeys(strategies))
    if "auto" in strategies:
        budgets = _budgets(ns.budgets)
        if RECOMPUTE_BUDGET in budgets and (
            "recompute" not in strategies
            or strategies.index("recompute") > strategies.index("auto")
        ):
            raise UsageError(
                "--budgets recompute needs recompute among --strategies, before auto "
                "(its measured peak is the budget)"
            )
        i = strategies.index("auto")
        strategies[i : i + 1] = [AUTO + b for b in budgets]
    if "offload-cpu" in strategies and device != "cuda":
        raise UsageError(
            "--strategies: offload-cpu needs --device cuda; the cpu tier leaves CPU tensors where "
            "they are, so on CPU it would only measure keep again (use offload-ssd)"
        )
    if ns.model in HF_FAMILIES and importlib.util.find_spec("transformers") is None:
        raise UsageError(
            f"--model {ns.model} needs transformers: pip install 'offloadd[hf]' "
            "(or use --model mini-gpt)"
        )
    if not ns.no_plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "rok.png needs matplotlib: pip install 'offloadd[rok]' (or pass --no-plot)"
        )
    try:
        memory_limit = parse_size("--memory-limit", ns.memory_limit)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if memory_limit < 0:
        raise UsageError(f"--memory-limit must not be negative, got {ns.memory_limit!r}")
    if ns.point_timeout is not None and ns.point_timeout <= 0:
        raise UsageError(f"--point-timeout must be positive, got {ns.point_timeout}")
    offload_dir = None
    if any(s in ("offload-ssd", "offload-cpu") or s.startswith(AUTO) for s in strategies):
        try:
            cfg = Config.from_env(base=Config(ssd_dirs=(ns.ssd_dir,) if ns.ssd_dir else ()))
            offload_dir = cfg.ssd_dirs[0] if cfg.ssd_dirs else default_offload_dir()
        except ValueError as e:
            raise UsageError(f"--ssd-dir: {e}") from None
    codec = getattr(ns, "codec", "none")
    try:
        CodecConfig(name=codec)  # type: ignore[arg-type]
    except ValueError as e:
        raise UsageError(f"--codec: {e}") from None
    out = Path(ns.out)
    try:  # last, so that a bad option creates nothing (Note [directories of the command line])
        if ns.ssd_dir:
            ready_dir("--ssd-dir", ns.ssd_dir)
        ready_dir("--out", out)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return Sweep(
        model=ns.model,
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=seq,
        vocab=ns.vocab if ns.vocab is not None else default_vocab(ns.model),
        batch_sizes=batch_sizes,
        strategies=strategies,
        device=device,
        allocator=cpu_allocator() if device == "cpu" else "auto",
        steps=steps,
        warmup=warmup,
        codec=codec,
        compile=getattr(ns, "compile", False),
        repeats=ns.repeats,
        out=out,
        ssd_dir=ns.ssd_dir,
        offload_dir=offload_dir,
        memory_limit=memory_limit,
        point_timeout=ns.point_timeout,
        resume=ns.resume,
        plot=not ns.no_plot,
    )
