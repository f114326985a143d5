"""A run's peak memory, predicted: what the process holds before it builds anything (measured
once, in a fresh interpreter that imports what a training run imports), plus the traced run's
peak through the allocator it trains on (the host cache replayed: hostcache.py; glibc's heap:
the live bytes, since how much more its heap keeps depends on the order of frees).

On CPU that is what a memory cgroup charges a run of ``offloadd wall``: its limit counts
anonymous memory and the page cache a run brings in, and torch's libraries are in the page cache
before any run starts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from dataclasses import dataclass

from offloadd.tools.predict.hostcache import replay
from offloadd.tools.predict.trace import TraceSpec, trace

__all__ = [
    "UNPREDICTED",
    "Prediction",
    "allocator_of",
    "base_bytes",
    "cap_budget",
    "predict",
    "predict_auto",
    "predict_run",
    "traced_as",
]

_TRACED_AS = {  # offloadd wall's and plan's names
    "plain": "plain",
    "recompute": "recompute",
    "sac": "sac",
    "offload-ssd": "offload",
    "offload-cpu": "plain",  # predictions are a CPU machine's, where tier cpu moves nothing
}

UNPREDICTED = {
    "auto": "auto is predicted inside a memory limit only (its budget is a share of what the "
    "limit leaves)",
    "compile-budget": "a compiled graph saves what its partitioner picks and reuses buffers as "
    "inductor plans them; the trace runs eager",
    "compile-offload": "a compiled graph is not traced",
    "torchtune-offload": "on a GPU only; device memory is not predicted",
}
"""Why a strategy has no prediction."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """A predicted peak and its parts (bytes)."""

    peak_bytes: int
    base_bytes: int  # the interpreter, torch and the libraries, before any tensor
    file_bytes: int  # the libraries' file-backed pages (in the RSS, not charged again)
    weights_bytes: int
    state_bytes: int  # gradients and optimizer state
    steps_bytes: int  # the steps' own peak above those: activations and temporaries
    allocator: str  # "caching" (the host cache replayed) or "system"
    blocks: int = 0  # the model's blocks, as auto's planner finds them


def traced_as(strategy: str) -> str | None:
    """What ``strategy`` (a wall name) is traced as, or None (UNPREDICTED says why)."""
    return _TRACED_AS.get(strategy)


@functools.cache
def _measured_base(spec: TraceSpec) -> tuple[int, int]:
    code = (
        "import json, sys, torch\n"
        "import offloadd.tools.harness.train\n"
        "from offloadd.tools.predict.trace import TraceSpec, trace\n"
        "trace(TraceSpec(**json.loads(sys.argv[1])), 'plain', 1, 8)\n"
        "lin = torch.nn.Linear(64, 64)\n"
        "lin(torch.randn(8, 64)).sum().backward()\n"
        "kib = dict(l.split()[:2] for l in open('/proc/self/status') if l.startswith('Rss'))\n"
        "print('base', kib['RssAnon:'], kib['RssFile:'])"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(dataclasses.asdict(spec))],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError("measuring the base memory took over 600 s") from None
    said = [line.split() for line in out.stdout.splitlines() if line.startswith("base ")]
    if out.returncode or not said:
        tail = out.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"measuring the base memory failed: {tail[0]}")
    return int(said[-1][1]) * 1024, int(said[-1][2]) * 1024


def base_bytes(spec: TraceSpec, *, file: bool = False) -> int:
    """Anonymous memory (``file``: file-backed resident memory, torch's libraries' pages) of a
    fresh interpreter that imported what a run imports, built the model on fake tensors (so the
    model's code is loaded: transformers loads it on first use) and trained a tiny real step (so
    torch's threads and kernels are set up): what a run holds before its tensors. Measured once
    per model and process."""
    model = dataclasses.replace(spec, steps=1, optimizer="none", min_bytes=1 << 20)
    return _measured_base(model)[1 if file else 0]


def allocator_of(strategy: str, *, held: bool) -> str:
    """The allocator ``strategy`` trains on, on a CPU machine: all on the host cache where it is
    held equal (``held``); else only those with an Offloader of tier ssd, which installs it."""
    return "caching" if held or traced_as(strategy) == "offload" or strategy == "auto" else "system"


@functools.lru_cache(maxsize=256)
def predict(
    spec: TraceSpec,
    strategy: str,
    batch: int,
    seq: int,
    *,
    allocator: str = "caching",
) -> Prediction:
    """The peak of ``strategy`` (traced_as must know it) at ``batch`` x ``seq``, on
    ``allocator``: ``caching`` (offloadd's host cache, installed once the model is built) or
    ``system`` (glibc's heap: the live bytes, its retention not predicted)."""
    kind = traced_as(strategy)
    if kind is None:
        raise ValueError(f"{strategy}: not predicted: {UNPREDICTED.get(strategy, 'unknown')}")
    run = trace(spec, kind, batch, seq)
    weights = run.held.get("build", 0)
    state = run.held.get("state", 0)
    steps = replay(run.events).resident if allocator == "caching" else run.peak
    base = base_bytes(spec)
    return Prediction(
        peak_bytes=base + steps,
        base_bytes=base,
        file_bytes=base_bytes(spec, file=True),
        weights_bytes=weights,
        state_bytes=state,
        steps_bytes=max(0, steps - weights - state),
        allocator=allocator,
        blocks=run.blocks,
    )


def cap_budget(p: Prediction, limit: int) -> int:
    """auto's budget inside ``limit``, as the harness gives it: ``CAP_SHARE`` of what the limit
    leaves below the RSS once the model and its state exist (0: nothing left)."""
    from offloadd.tools.harness.train import CAP_SHARE

    rss = p.base_bytes + p.file_bytes + p.weights_bytes + p.state_bytes
    return max(0, int(CAP_SHARE * (limit - rss)))


def predict_auto(spec: TraceSpec, batch: int, seq: int, limit: int) -> Prediction:
    """auto inside a memory limit, as ``offloadd wall`` runs it (tools/harness/train.py): its
    budget is ``cap_budget``, and its plan keeps whole blocks while their saved bytes fit what
    the budget leaves beside offloading the rest. So its peak is offload-ssd's plus the blocks
    that fit, each block taken to save an equal share of what plain saves beyond offload-ssd,
    or plain's where every block fits. Which blocks, and whether a kept plan survives its race
    against offloading every block, follow measured step times; the peak of a run counts the
    race's steps too."""
    plain = predict(spec, "plain", batch, seq)
    budget = cap_budget(plain, limit)
    if plain.steps_bytes <= budget or not plain.blocks:
        return plain
    offload = predict(spec, "offload-ssd", batch, seq)
    per_block = max(1.0, (plain.steps_bytes - offload.steps_bytes) / plain.blocks)
    kept = min(plain.blocks, max(0, int((budget - offload.steps_bytes) // per_block)))
    if kept == plain.blocks:
        return plain
    more = int(kept * per_block)
    return dataclasses.replace(
        offload,
        peak_bytes=offload.peak_bytes + more,
        steps_bytes=offload.steps_bytes + more,
    )


def predict_run(
    spec: TraceSpec, strategy: str, batch: int, seq: int, *, limit: int | None, held: bool
) -> Prediction:
    """``strategy`` (a wall name) as ``offloadd wall`` runs it: auto inside ``limit``, the others
    on the allocator they train on (``allocator_of``)."""
    if strategy == "auto":
        if limit is None:
            raise ValueError("auto is predicted inside a limit only")
        return predict_auto(spec, batch, seq, limit)
    return predict(spec, strategy, batch, seq, allocator=allocator_of(strategy, held=held))
