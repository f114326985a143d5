"""One run of ``offloadd bench relay``, in its own process: a frozen-backbone fine-tune of an HF
Llama, with its frozen weights relayed or resident.

``python -m offloadd.tools.bench.relay_run --json SPEC`` prints the result as JSON (the harness's
child protocol, harness/child.py). The model is ``LlamaForCausalLM`` from a ``LlamaConfig``
(random weights, nothing downloaded). Frozen: every Linear weight of the decoder layers.
Trainable: the rest (norms, embeddings, ``lm_head``), under AdamW. The RSS baseline is taken
before the model is built; the RSS high-water mark is reset once the model is set up (built,
relayed), so that the peak is the training steps' own and not the moment when every weight was
still resident before relay moved it out.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import offloadd
from offloadd.config import Config
from offloadd.runtime import host_allocator
from offloadd.tools.harness.child import child_main
from offloadd.tools.harness.memory import peak_rss_since_reset, reset_peak_rss, rss
from offloadd.tools.harness.step_trace import StepTrace, medians
from offloadd.tools.models.hf import require_transformers

__all__ = ["MODULE", "RelaySpec", "build_llama", "freeze_backbone", "main", "run"]

MODULE = "offloadd.tools.bench.relay_run"


@dataclass(kw_only=True, slots=True)
class RelaySpec:
    layers: int = 32
    hidden: int = 512
    intermediate: int = 1376
    heads: int = 8
    vocab: int = 2000
    batch: int = 2
    seq: int = 128
    warmup: int = 3
    """Untimed steps first."""
    steps: int = 8
    """Timed steps, after the warm-up."""
    seed: int = 0
    relay: bool = False
    """The frozen weights relayed (``offloadd.relay``), or resident as usual."""
    window: int = 2
    tier: str = "ssd"
    ssd_dir: str | None = None
    threads: int = 0
    """torch's threads (0: torch's default)."""
    allocator: str = "system"
    """torch's CPU allocator: system (glibc), caching (offloadd's host cache, installed once the
    model is built and relayed, where an Offloader would), jemalloc or tcmalloc (preloaded)."""


def build_llama(spec: RelaySpec) -> nn.Module:
    """``LlamaForCausalLM`` of ``spec``'s sizes, random weights (seeded by the caller), in
    training mode."""
    tf = require_transformers()
    cfg = tf.LlamaConfig(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        vocab_size=spec.vocab,
        max_position_embeddings=spec.seq,
        use_cache=False,
    )
    model: nn.Module = tf.LlamaForCausalLM(cfg)
    return model.train()


def freeze_backbone(model: nn.Module) -> int:
    """Freeze every Linear weight of the decoder layers (``model.model.layers``), leave the rest
    trainable; the frozen bytes."""
    layers = model.get_submodule("model.layers")
    frozen = {id(m.weight): m.weight for m in layers.modules() if isinstance(m, nn.Linear)}
    for p in model.parameters():
        p.requires_grad_(id(p) not in frozen)
    return sum(p.nbytes for p in frozen.values())


def _digest(params: list[nn.Parameter]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _relay_stats(model: nn.Module, *, reset_peak: bool = False) -> dict[str, Any]:
    return dataclasses.asdict(offloadd.relay_stats(model, reset_peak=reset_peak))


def run(spec: RelaySpec, *, progress: bool = False) -> dict[str, Any]:
    try:
        return _run(spec, progress)
    finally:
        if spec.allocator == "caching":
            host_allocator.release()


def _run(spec: RelaySpec, progress: bool) -> dict[str, Any]:
    """Build, freeze, relay (with ``spec.relay``), train ``spec.warmup`` untimed steps and
    ``spec.steps`` timed ones; return the timings, memory, relay's counters and the losses."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    tf = require_transformers()
    _ = tf.LlamaConfig, tf.LlamaForCausalLM  # their modules imported before the baseline
    gc.collect()
    base_rss = rss()
    torch.manual_seed(spec.seed)
    model = build_llama(spec)
    frozen_bytes = freeze_backbone(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    if spec.relay:
        cfg = Config(tier=spec.tier, ssd_dirs=(spec.ssd_dir,) if spec.ssd_dir else ())  # type: ignore[arg-type]
        model = offloadd.relay(model, window=spec.window, config=cfg)
    if spec.allocator == "caching":
        host_allocator.acquire()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    gc.collect()
    setup_rss = rss()
    reset_peak_rss()
    clock = StepTrace()
    trace: list[dict[str, Any]] = []
    losses: list[float] = []
    warm_stats: dict[str, Any] | None = None
    for step in range(spec.warmup + spec.steps):
        warm = step < spec.warmup
        if step == spec.warmup and spec.relay:  # the timed steps' own peak from here
            warm_stats = _relay_stats(model, reset_peak=True)
        batch = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=gen)
        clock.begin()
        loss = model(input_ids=batch, labels=batch).loss
        clock.mark()
        loss.backward()
        clock.mark()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
        del loss
        rec = clock.end()
        rec["warmup"] = warm
        trace.append(rec)
        if progress:
            where = f"warm-up {step + 1}" if warm else f"step {step - spec.warmup + 1}"
            print(
                f"  [{'relay' if spec.relay else 'plain'} {spec.layers}] {where}: "
                f"loss {losses[-1]:.4f}, {rec['step_s']:.3f}s",
                file=sys.stderr,
                flush=True,
            )
    peak = peak_rss_since_reset()
    timed = [r for r in trace if not r["warmup"]]
    times = [r["step_s"] for r in timed]
    out: dict[str, Any] = {
        "layers": spec.layers,
        "relay": spec.relay,
        "window": spec.window if spec.relay else None,
        "tier": spec.tier if spec.relay else None,
        "frozen_bytes": frozen_bytes,
        "trainable_bytes": sum(p.nbytes for p in trainable),
        "base_rss": base_rss,
        "setup_rss_above_base": setup_rss - base_rss,
        # the training steps' peak (the high-water mark was reset after setup)
        "peak_rss_above_base": max(0, peak - base_rss),
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "warmup_steps": spec.warmup,
        "trace": trace,
        "trace_median": medians(timed),
        "losses": losses,
        "trainable_sha256": _digest(trainable),
    }
    if spec.relay:
        end = _relay_stats(model)
        start = warm_stats if warm_stats is not None else end
        out["relay_stats"] = end
        out["relay_stats_warmup"] = start  # at the first timed step, before its peak reset
        out["peak_resident_bytes"] = end["peak_resident_bytes"]  # over the timed steps
        out["read_bytes_per_step"] = (end["read_bytes"] - start["read_bytes"]) / spec.steps
        out["wait_s_per_step"] = (end["wait_s"] - start["wait_s"]) / spec.steps
    else:
        out["peak_resident_bytes"] = frozen_bytes  # every frozen weight stays resident
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m offloadd.tools.bench.relay_run --json SPEC``: one run, its result as JSON."""
    return child_main(
        MODULE, lambda spec, progress: run(RelaySpec(**spec), progress=progress), argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
