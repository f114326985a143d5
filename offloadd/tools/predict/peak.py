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
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from offloadd.runtime.host_allocator import SLACK
from offloadd.tools.predict.hostcache import Replay, replay
from offloadd.tools.predict.trace import Traced, TraceSpec, trace

__all__ = [
    "UNPREDICTED",
    "Prediction",
    "allocator_of",
    "base_bytes",
    "cap_budget",
    "compiler_bytes",
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
    "compile-budget": "compile-budget",
}

UNPREDICTED = {
    "auto": "auto is predicted inside a memory limit only (its budget is a share of what the "
    "limit leaves)",
    "compile-offload": "on a GPU only; device memory is not predicted",
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
    compiler_bytes: int = 0  # compile-budget: what torch.compile holds (compiler_bytes)
    # offload without a budget: what writes behind a slow disk may hold above ``peak_bytes``
    # (Note [writes behind a slow disk]); auto's peak counts its own
    writes_bytes: int = 0

    @property
    def slow_disk_peak_bytes(self) -> int:
        """The peak where the disk falls behind the writes: ``peak_bytes + writes_bytes``."""
        return self.peak_bytes + self.writes_bytes


def traced_as(strategy: str) -> str | None:
    """What ``strategy`` (a wall name) is traced as, or None (UNPREDICTED says why)."""
    return _TRACED_AS.get(strategy)


@functools.cache
def _measured_base(spec: TraceSpec) -> tuple[int, int]:
    return _run_base("the base memory", _BASE, spec)


def _run_base(
    what: str, code: str, spec: TraceSpec, *args: str, env: dict[str, str] | None = None
) -> tuple[int, int]:
    """RssAnon and RssFile as ``code`` prints them, run in a fresh interpreter to measure
    ``what`` (named in its errors)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(dataclasses.asdict(spec)), *args],
            capture_output=True,
            text=True,
            timeout=900,
            env=None if env is None else {**os.environ, **env},
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"measuring {what} took over 900 s") from None
    said = [line.split() for line in out.stdout.splitlines() if line.startswith("base ")]
    if out.returncode or not said:
        tail = out.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(
            f"measuring {what} failed (exit status {out.returncode}): {tail[0]}"[:400]
        )
    return int(said[-1][1]) * 1024, int(said[-1][2]) * 1024


_BASE = (
    "import json, sys, torch\n"
    "import offloadd.tools.harness.train\n"
    "from offloadd.tools.predict.trace import TraceSpec, trace\n"
    "trace(TraceSpec(**json.loads(sys.argv[1])), 'plain', 1, 8)\n"
    "lin = torch.nn.Linear(64, 64)\n"
    "lin(torch.randn(8, 64)).sum().backward()\n"
    "kib = dict(l.split()[:2] for l in open('/proc/self/status') if l.startswith('Rss'))\n"
    "print('base', kib['RssAnon:'], kib['RssFile:'])"
)


_COMPILED_STEPS = (
    "import json, sys, torch\n"
    "import torch._functorch.config as functorch_config\n"
    "from offloadd.runtime import host_allocator\n"
    "from offloadd.tools.harness.peers import COMPILE_MEMORY_BUDGET\n"
    "from offloadd.tools.models.build import build_model\n"
    "spec, compile, seq = json.loads(sys.argv[1]), sys.argv[2] == '1', int(sys.argv[3])\n"
    "functorch_config.activation_memory_budget = COMPILE_MEMORY_BUDGET\n"
    "built = build_model(spec['model'], num_layers=spec['layers'], d_model=spec['hidden'],\n"
    "    num_heads=spec['heads'], seq_len=seq, vocab_size=spec['vocab'],\n"
    "    hf_config=spec['hf_config'], compile=compile)\n"
    "built.module.to(dtype=getattr(torch, spec['dtype']))\n"
    "opt = torch.optim.AdamW(built.module.parameters(), lr=1e-3)\n"
    "cache = host_allocator.acquire()\n"
    "for _ in range(2):\n"
    "    x = torch.randint(0, built.vocab_size, (1, seq + 1))\n"
    "    built.loss(x[:, :-1], x[:, 1:]).backward()\n"
    "    opt.step()\n"
    "    opt.zero_grad()\n"
    "c = cache.counters()\n"
    "kib = dict(l.split()[:2] for l in open('/proc/self/status') if l.startswith('Rss'))\n"
    "print('base', int(kib['RssAnon:']) - (c.live_bytes + c.cached_bytes) // 1024, kib['RssFile:'])"
)


def compiler_bytes(spec: TraceSpec, seq: int) -> int:
    """The anonymous memory torch.compile holds once it has compiled ``spec``'s model whole and
    trained it at ``seq`` (dynamo's and AOTAutograd's graphs, inductor, the kernels it loaded
    and what they allocate below the host cache's least size): the same two real steps at batch
    1, compiled and not, each in a fresh interpreter with the host cache holding the tensors,
    and the difference of their RssAnon beside the cache's bytes. The compiled one compiles for
    real, from an empty inductor cache of its own (a compile that finds its kernels cached
    holds less), a minute or more on a small machine, and the model and its AdamW state must
    fit in memory; once per model, sequence and process."""
    return _measured_compiler(_model_of(spec), seq)


@functools.cache
def _measured_compiler(model: TraceSpec, seq: int) -> int:
    what = "the compiler's memory (two real steps at batch 1)"
    eager = _run_base(what, _COMPILED_STEPS, model, "0", str(seq))[0]
    with tempfile.TemporaryDirectory(prefix="offloadd-compile-") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        compiled = _run_base(what, _COMPILED_STEPS, model, "1", str(seq), env=env)[0]
    return max(0, compiled - eager)


def base_bytes(spec: TraceSpec, *, file: bool = False) -> int:
    """Anonymous memory (``file``: file-backed resident memory, torch's libraries' pages) of a
    fresh interpreter that imported what a run imports, built the model on fake tensors (so the
    model's code is loaded: transformers loads it on first use) and trained a tiny real step (so
    torch's threads and kernels are set up): what a run holds before its tensors. Measured once
    per model and process."""
    return _measured_base(_model_of(spec))[1 if file else 0]


def _model_of(spec: TraceSpec) -> TraceSpec:
    """``spec`` with only what names the model: one measurement serves every run of it."""
    return dataclasses.replace(
        spec, steps=1, optimizer="none", min_bytes=1 << 20, staging_bytes=TraceSpec().staging_bytes
    )


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
    steps = replay(run.events).resident if allocator == "caching" else run.peak
    compiler = compiler_bytes(spec, seq) if kind == "compile-budget" else 0
    p = _prediction(spec, run, steps, allocator, compiler)
    if kind == "offload":  # Note [writes behind a slow disk]: at most what offloading saved
        saved = predict(spec, "plain", batch, seq, allocator=allocator).peak_bytes - p.peak_bytes
        p = dataclasses.replace(p, writes_bytes=min(spec.staging_bytes, max(0, saved)))
    return p


# Note [writes behind a slow disk]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The trace's ideal offloader frees what it moves at pack. offloadd's ssd tier writes a CPU
# tensor from its own pages and holds it until written, up to ``staging_bytes`` (Note
# [zero-copy] in runtime/writer_in_place.py), before forward waits. While the disk keeps up,
# little is held at the peak; when it falls behind for a moment, up to ``staging_bytes`` is, and
# that happens on a quiet machine too (the wall-writes page in docs/benchmarks/). So
# offload without a budget is predicted twice: ``peak_bytes``, the disk keeping up, and
# ``slow_disk_peak_bytes``, with ``staging_bytes`` of writes held on top, which is the room a
# limit must leave (``offloadd plan``'s largest batch). What is held is what plain would hold
# too, so no more is added than offloading saved against plain (nothing, where every tensor is
# below ``min_bytes``). auto's budget bounds its writes, and its peak counts them (Note [auto's
# peak predicted]).


def _prediction(
    spec: TraceSpec, run: Traced, steps: int, allocator: str, compiler: int = 0
) -> Prediction:
    """``run``'s prediction, ``steps`` its peak through ``allocator``."""
    weights = run.held.get("build", 0)
    state = run.held.get("state", 0)
    base = base_bytes(spec)
    return Prediction(
        peak_bytes=base + compiler + steps,
        base_bytes=base,
        file_bytes=base_bytes(spec, file=True),
        weights_bytes=weights,
        state_bytes=state,
        steps_bytes=max(0, steps - weights - state),
        allocator=allocator,
        blocks=run.blocks,
        compiler_bytes=compiler,
    )


def cap_budget(p: Prediction, limit: int) -> int:
    """auto's budget inside ``limit``, as the harness gives it: ``CAP_SHARE`` of what the limit
    leaves below the RSS once the model and its state exist (0: nothing left)."""
    from offloadd.tools.harness.train import CAP_SHARE

    rss = p.base_bytes + p.file_bytes + p.weights_bytes + p.state_bytes
    return max(0, int(CAP_SHARE * (limit - rss)))


def predict_auto(spec: TraceSpec, batch: int, seq: int, limit: int) -> Prediction:
    """auto inside a memory limit, as ``offloadd wall`` runs it (tools/harness/train.py; Note
    [auto's peak predicted])."""
    plain = predict(spec, "plain", batch, seq)
    budget = cap_budget(plain, limit)
    units = plain.blocks + 1
    low = _planned(spec, batch, seq, 0)[0]  # offloading every unit
    saved = (_planned(spec, batch, seq, units)[0] - low) / max(1, plain.blocks)
    # the planner's reckoning: a kept block needs its forward's peak and its saved bytes on top
    # of what the units before it hold (solver.py, [the plan])
    kept = min(units, 1 + max(0, int((budget - low) // saved)) if saved > 0 else units)
    step_live, run, cache = _planned(spec, batch, seq, kept)
    if kept == units:  # every unit kept: nothing is written
        return _prediction(spec, run, cache.resident, "caching")
    writes = max(0, min(budget - step_live, spec.staging_bytes))
    return _prediction(spec, run, cache.resident + int(writes * (1 + SLACK)), "caching")


# Note [auto's peak predicted]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inside a limit, auto's budget is ``cap_budget``. It bounds the step's live bytes in the host
# cache above the level the step began at; the cache is installed after the gradients and
# optimizer state exist, so they are outside it. The plan predicted is the one the planner
# makes from its profile, in which every unit is offloaded: it keeps the head, then blocks from
# the last back, while what the units before a kept block hold, plus that block's forward peak
# (the profile's, taken as offloading every unit's step peak) and its saved bytes, fit the
# budget; the rest are offloaded. It keeps fewer blocks than fit in fact, by about one block's
# forward peak, which it counts beside that block's saved bytes. Which blocks follow measured
# times, but on a model of equal blocks any choice of as many holds as much. The plan is traced
# (``trace``'s ``kept``). The trace's ideal offloader holds no write in flight, where offloadd
# holds up to ``staging_bytes`` of them within what the budget leaves beside the plan (Note
# [room for writes] in runtime/writer_in_place.py), and its host cache keeps up to ``1 + SLACK``
# times its live peak: so a plan that offloads is predicted at the replay's peak plus ``1 +
# SLACK`` times those writes. The run's peak is that plan's even where its race then picks
# offloading every block (race.py): the race runs it. Measured against the wall: run F of
# docs/benchmarks/wall_hf-gpt2_cpu-2core_2026-12-06_predicted.md.


@functools.lru_cache(maxsize=256)
def _planned(spec: TraceSpec, batch: int, seq: int, n: int) -> tuple[int, Traced, Replay]:
    """auto's plan that keeps the last ``n`` units (the blocks and what runs after them), traced:
    the step's live bytes above its start in the host cache, the run and its replay."""
    blocks = predict(spec, "plain", batch, seq).blocks
    kept = tuple(k > blocks - n for k in range(blocks + 1))
    run = trace(spec, "offload", batch, seq, kept=kept)
    cache = replay(run.events, before=("build", "state"))
    return cache.step_live, run, cache


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
