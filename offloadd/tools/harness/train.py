"""One measured training run of a model: what the demo, ``offloadd rok`` and the benchmarks execute.

Each strategy runs in its own process (``python -m offloadd.tools.harness.train``) so that its peak RSS
is its own; the parent compares the JSON each child prints. A run that runs out of memory
reports ``"oom": true`` instead of failing.
"""

from __future__ import annotations

import hashlib
import os
import signal
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offloadd.auto import plan_dict
from offloadd.auto.plan_report import decision_counts
from offloadd.auto.planner import WARMUP_STEPS as AUTO_WARMUP
from offloadd.auto.planner import WARMUP_STEPS_MAX as AUTO_WARMUP_MAX
from offloadd.config import CodecConfig, Config
from offloadd.io.buffers import address_view
from offloadd.offloader import Offloader
from offloadd.runtime import host_allocator
from offloadd.tools.harness.child import RunFailed, child_main, run_module
from offloadd.tools.harness.memory import is_oom, limit_memory, peak_rss, rss, unlimit_memory
from offloadd.tools.harness.peers import PEERS, prepare
from offloadd.tools.harness.step_trace import (
    ALLOCATORS,
    HOST_ALLOCATOR,
    StepTrace,
    allocator_used,
    medians,
    preload_env,
)
from offloadd.tools.models.build import build_model

__all__ = [
    "CAP_SHARE",
    "OWN_CACHE",
    "STRATEGIES",
    "RunFailed",
    "RunSpec",
    "failure",
    "main",
    "plan_counts",
    "run",
    "run_in_subprocess",
    "split_label",
    "warmup_steps",
]

STRATEGIES = ("none", "keep", "recompute", "ssd", "cpu", "auto", "sac", *PEERS)
OWN_CACHE = ("none", "recompute", "sac", *PEERS)
"""The strategies without an Offloader: with ``allocator="caching"`` the run installs the host
cache itself, so that they train on the allocator offloadd's own strategies use."""


def warmup_steps(strategy: str, warmup: int, *, compile: bool) -> int:
    """The untimed steps a run of ``strategy`` takes at the least when ``warmup`` are asked for:
    ``AUTO_WARMUP`` for auto (its warm-up forward, profile, shortest race and first step under its
    final plan; a longer race takes up to ``AUTO_WARMUP_MAX``: auto warms up until its planner is
    settled and has run one step so), 2 compiled (the backward compiles in the second)."""
    return max(warmup, AUTO_WARMUP if strategy == "auto" else 2 if compile else 0)


@dataclass(kw_only=True, slots=True)
class RunSpec:
    strategy: str = "ssd"
    """none (no hooks), keep (hooks, nothing moved), recompute, ssd or cpu (offload tiers),
    auto (tier ssd under ``budget``: keep, offload or recompute per block), and peers without
    offloadd: sac (selective checkpointing, models/sac.py) and those of peers.py (torch.compile's
    recompute planner and activation offloading, torchtune's offloading)."""
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 8
    """Timed steps, after ``warmup`` untimed ones."""
    warmup: int = 3
    """Untimed steps first; auto and compiled runs take more (``warmup_steps``)."""
    allocator: str = "auto"
    """torch's CPU allocator (see ``step_trace.ALLOCATORS``): auto, system, caching (offloadd's
    host cache, with or without an Offloader), jemalloc or tcmalloc (preloaded)."""
    seed: int = 0
    device: str = "cpu"
    ssd_dir: str | None = None
    min_bytes: int = 1 << 20
    model: str = "mini-gpt"
    """mini-gpt (built in), or gpt, bert, t5 (transformers, random weights); see models.build."""
    vocab_size: int | None = None
    """None: the model's usual vocabulary."""
    codec: str = "none"
    """Strategies with offloadd's hooks: ``codec.name`` (lossy compression of what is saved)."""
    budget: str | None = None
    """auto: the budget (``Config.budget``: a size or a fraction of keep's, ``0.3x``)."""
    compile: bool = False
    """The model compiled whole (``torch.compile(model)``, inductor) for every strategy."""
    memory_limit_bytes: int = 0
    """Simulates a smaller machine: memory allowed above what the built model holds (0: no
    limit). CPU: an RLIMIT_AS on address space, so approximate; CUDA: a per-process fraction."""
    hf_config: str | None = None
    """A directory holding a transformers ``config.json``: its causal LM instead of ``model``
    (the sizes are the config's; ``seq_len`` and ``batch_size`` still apply)."""
    memory_cap_bytes: int = 0
    """The hard limit the run is inside (0: none): on CPU the memory cgroup its parent made, as
    ``offloadd wall`` does; on CUDA the device memory it may take (a per-process fraction, set
    before the model is built). auto without a budget then takes ``CAP_SHARE`` of what the cap
    leaves once the model, its gradients and optimizer state exist."""
    dtype: str = "float32"
    """The model's parameters' dtype (``bfloat16``: pure bf16 training, as fine-tunes on a GPU
    often run)."""


CAP_SHARE = 1 / (1 + host_allocator.SLACK)
"""auto inside a cap: its budget is this share of the memory the cap leaves for the steps. The
budget bounds the activations' peak as the host cache counts it (live bytes), and the cache keeps
live plus cached bytes within ``1 + SLACK`` times that peak, all of which the cgroup charges.
(0.6 was too little: on HF GPT-2 8L d512 in 2 GiB, auto found no plan at batch 24, which
offload-ssd trains; docs/benchmarks/wall_hf-gpt2_cpu-2core_2026-12-06.md.)"""


def split_label(label: str, codec: str, allocator: str = "auto") -> tuple[str, str, str]:
    """(strategy, codec, allocator) of a strategy label of ``bench step`` or ``rok``,
    ``strategy[+codec][:allocator]``: ``ssd+int8:system`` -> ("ssd", "int8", "system");
    without a plus ``codec``, without a colon ``allocator`` (their options)."""
    rest, at, alloc = label.partition(":")
    base, plus, named = rest.partition("+")
    return base, named if plus else codec, alloc if at else allocator


def run(spec: RunSpec, *, progress: bool = False) -> dict[str, Any]:
    """Train untimed steps (``spec.warmup``, more for auto and compiled: ``warmup_steps``), then
    ``spec.steps`` timed ones; return timings (the median and a per-step trace, see
    step_trace.py), memory, stats and a digest of the weights."""
    acquired: list[bool] = []  # the host cache, acquired for a run without an Offloader
    try:
        return _run(spec, progress, acquired)
    finally:
        if acquired:
            host_allocator.release()


def _run(spec: RunSpec, progress: bool, acquired: list[bool]) -> dict[str, Any]:
    if spec.strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {spec.strategy!r}")
    if spec.allocator not in ALLOCATORS:
        raise ValueError(
            f"allocator must be one of {', '.join(ALLOCATORS)}, got {spec.allocator!r}"
        )
    torch.manual_seed(spec.seed)
    device = torch.device(spec.device)
    whole, peer_scope = prepare(spec.strategy)
    compiled = spec.compile or whole
    if spec.memory_cap_bytes and device.type == "cuda":  # the limit is the device's
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec.memory_cap_bytes / total), device)
    built = build_model(
        spec.model,
        num_layers=spec.num_layers,
        d_model=spec.d_model,
        num_heads=spec.num_heads,
        seq_len=spec.seq_len,
        vocab_size=spec.vocab_size,
        recompute=spec.strategy in ("recompute", "sac"),
        selective=spec.strategy == "sac",
        compile=compiled,
        hf_config=spec.hf_config,
    )
    model = built.module.to(device, dtype=getattr(torch, spec.dtype))
    vocab = built.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    # auto: its warm-up forward, profile, race and first step under the final plan go untimed
    warmup = warmup_steps(spec.strategy, spec.warmup, compile=compiled)
    longest = max(warmup, AUTO_WARMUP_MAX) if spec.strategy == "auto" else warmup
    off = None
    # where an Offloader would install it: after the model and its optimizer are built
    own_cache = spec.allocator == "caching" and spec.strategy in OWN_CACHE
    if own_cache:
        host_allocator.acquire()  # the host cache without an Offloader
        acquired.append(True)
    capped = spec.strategy == "auto" and not spec.budget and spec.memory_cap_bytes > 0
    if spec.strategy == "auto" and not spec.budget and not capped:
        raise ValueError("strategy auto needs a budget")
    if spec.strategy in ("keep", "ssd", "cpu", "auto") and not capped:
        off = _offloader(spec, spec.budget)
    # Gradients and optimizer state exist before the baseline is taken, so that the memory
    # figures measure activations only. Every strategy does the same, so results stay comparable.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    if capped:  # the budget: a share of what the cap leaves now (see CAP_SHARE)
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else rss()
        left = spec.memory_cap_bytes - held
        if left <= 0:
            raise MemoryError(f"the model holds more than the cap of {spec.memory_cap_bytes} bytes")
        off = _offloader(spec, str(int(CAP_SHARE * left)))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_rss = rss()
    base_dev = torch.cuda.memory_allocated() if cuda else 0
    cache = host_allocator.current()  # offloadd's host cache: torch's CPU allocator, counted
    base_live = cache.counters().live_bytes if cache is not None else None
    if spec.memory_limit_bytes > 0:
        limit_memory(spec.memory_limit_bytes, cuda, base_dev)
    trace: list[dict[str, Any]] = []
    clock = StepTrace()
    losses: list[float] = []
    oom_error = None
    loss: torch.Tensor | None = None
    step = 0
    ran_warmup = 0
    warm = True
    try:
        while True:
            # untimed: the first ``warmup``; auto's until the step after its planner settled;
            # once a step is timed, every later one is (a later replan shows in auto_settled)
            warm = warm and (
                step < warmup
                or (step < longest and bool(trace) and trace[-1].get("auto_settled") is False)
            )
            if not warm and step - ran_warmup >= spec.steps:
                break
            ran_warmup += warm
            batch = torch.randint(0, vocab, (spec.batch_size, spec.seq_len + 1), generator=gen).to(
                device
            )
            clock.begin(off.stats() if off is not None else None)
            if off is not None:
                with off:
                    loss = built.loss(batch[:, :-1], batch[:, 1:])
            else:
                with peer_scope():
                    loss = built.loss(batch[:, :-1], batch[:, 1:])
            clock.mark()  # on CUDA: when the host queued it (no sync between phases)
            loss.backward()
            clock.mark()
            opt.step()
            opt.zero_grad(set_to_none=False)
            losses.append(loss.item())
            loss = None
            if cuda:
                torch.cuda.synchronize()
            rec = clock.end(off.stats() if off is not None else None)
            rec["warmup"] = warm
            if off is not None and off.planner is not None:
                rec["auto_settled"] = off.planner.settled  # no profile or race pending
            trace.append(rec)
            dt = rec["step_s"]
            if progress:
                print(
                    f"  [{spec.strategy}] "
                    + (f"warm-up step {step + 1}" if warm else f"step {step - ran_warmup + 1}")
                    + f"/{spec.steps}: loss {losses[-1]:.4f}, {dt:.2f}s",
                    file=sys.stderr,
                    flush=True,
                )
            step += 1
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        oom_error = f"{type(e).__name__}: {e}"[:500]
        loss = None  # drop the half-built graph before the offloader closes
    if spec.memory_limit_bytes > 0 and not cuda:
        unlimit_memory()
    timed = [r for r in trace if not r["warmup"]]
    times = [r["step_s"] for r in timed]
    stolen = [r["steal_s"] for r in timed if r["steal_s"] is not None]
    digest = hashlib.sha256()
    for p in model.parameters():
        flat = p.detach().cpu().contiguous()
        digest.update(address_view(flat.data_ptr(), flat.nbytes))
    out: dict[str, Any] = {
        "model": spec.model,
        "strategy": spec.strategy,
        "allocator": allocator_used(
            spec.allocator, off.stats().host_allocator if off is not None else None
        ),
        "batch_size": spec.batch_size,
        "oom": oom_error is not None,
        "error": oom_error,
        "step_time_s": statistics.median(times) if times else float("nan"),
        "step_times_s": times,
        # what ran (auto: until its planner settled); an early out-of-memory: what was asked
        "warmup_steps": max(ran_warmup, warmup),
        # auto: its plan final (no profile or race) at the end of every timed step
        "auto_settled": all(r["auto_settled"] for r in timed) if spec.strategy == "auto" else None,
        # one record per step, warm-ups included (step_trace.py), and the timed steps' medians
        "trace": trace,
        "trace_median": medians(timed),
        # machine-wide: CPU time the hypervisor took per timed step (None: not reported)
        "steal_s": statistics.median(stolen) if stolen else None,
        "losses": losses,
        "weights_sha256": digest.hexdigest(),
        "peak_rss_above_base": max(0, peak_rss() - base_rss),
        "peak_rss": peak_rss(),  # the process's, torch and the model included
        "params": built.num_params,
        "tokens_per_step": spec.batch_size * spec.seq_len,
        "flops_per_step": built.flops_per_step(spec.batch_size, spec.seq_len),
    }
    if cuda:
        out["peak_device_above_base"] = torch.cuda.max_memory_allocated() - base_dev
        out["peak_device"] = torch.cuda.max_memory_allocated()  # the model included
    if cache is not None and base_live is not None:
        # what the allocator counts (the budget's measure, [measured peaks] in auto/probe.py)
        out["peak_live_above_base"] = max(0, cache.counters().peak_live_bytes - base_live)
    if off is not None:
        out["stats"] = off.stats().as_dict()
        plan = off.plan()
        if plan is not None:
            out["plan"] = plan_dict(plan)
        off.close()
    return out


def failure(e: RunFailed, *, oom_killed: bool = False) -> dict[str, Any]:
    """The status and error of a run whose process failed: ``oom`` where it was killed for
    memory (``oom_killed``: its cgroup counted the kill; SIGKILL: what the kernel's OOM killer
    sends a process that outgrew the machine) or an allocation failed; ``infeasible`` where
    auto's planner found no plan within its budget (a result, not a failure); else ``error``
    with the last line of its stderr."""
    if oom_killed:
        return {"status": "oom", "error": "killed by the kernel's OOM killer at the limit"}
    if e.returncode == -signal.SIGKILL:
        return {"status": "oom", "error": "killed by SIGKILL (out of memory?)"}
    last = [ln for ln in e.stderr.strip().splitlines() if ln.strip()]
    msg = last[-1] if last else f"exit {e.returncode}"
    if msg.startswith("MemoryError") or "out of memory" in msg.lower():
        return {"status": "oom", "error": msg[:300]}
    if "InfeasibleBudget" in msg:
        return {"status": "infeasible", "error": msg.split(": ", 1)[-1][:300]}
    return {"status": "error", "error": msg[:300]}


def plan_counts(plan: dict[str, Any]) -> str:
    """A run's auto plan (``plan_dict``) as its blocks kept, offloaded, recomputed: "k2 o10 r0"."""
    return decision_counts([b["decision"] for b in plan["blocks"]])


def _offloader(spec: RunSpec, budget: str | None) -> Offloader:
    """The Offloader of a strategy with offloadd's hooks (auto: tier ssd under ``budget``)."""
    cfg = Config(
        tier="ssd" if spec.strategy == "auto" else spec.strategy,  # type: ignore[arg-type]
        ssd_dirs=(spec.ssd_dir,) if spec.ssd_dir else (),
        min_bytes=spec.min_bytes,
        codec=CodecConfig(name=spec.codec),  # type: ignore[arg-type]
        host_allocator=HOST_ALLOCATOR[spec.allocator],  # type: ignore[arg-type]
    )
    return Offloader(
        Config.from_env(base=cfg.replace(budget=budget if spec.strategy == "auto" else None))
    )


def run_in_subprocess(
    spec: RunSpec,
    *,
    progress: bool = False,
    timeout: float | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter (clean peak RSS); raise with its stderr if it fails.
    ``preexec_fn``: see ``child.run_module``."""
    return run_module(
        "offloadd.tools.harness.train",
        _spec_dict(spec),
        what=f"training run {spec.strategy}",
        progress=progress,
        timeout=timeout,
        env=preload_env(spec.allocator, os.environ),
        preexec_fn=preexec_fn,
    )


def _spec_dict(spec: RunSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in RunSpec.__dataclass_fields__}


def main(argv: list[str] | None = None) -> int:
    """``python -m offloadd.tools.harness.train --json SPEC``: run the spec, print its result as JSON."""
    return child_main(
        "offloadd.tools.harness.train",
        lambda spec, progress: run(RunSpec(**spec), progress=progress),
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
