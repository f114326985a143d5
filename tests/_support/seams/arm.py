"""One arm of a seams cell: a few training steps of a small model with the cell's user tools,
with offloadd's features (the arm under test) or without (the reference).

What an arm records (a ``Trace``, a dict of tensors and numbers that ``torch.save`` keeps): each
forward's loss, each step's trainable gradients and the RNG state after backward, what the
between-steps tools observed (eval losses, a state dict), the final state dict, and what
offloadd did (bytes moved, relayed, modules swapped), so that a cell cannot pass by doing nothing.
offloadd is imported only where a feature asks for it: the arm of ``OFFLOADD=1`` runs as an
unmodified script.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests._support.seams import net

__all__ = ["ArmSpec", "Refused", "run"]

Trace = dict[str, Any]

STEPS = 6
OFFLOADER_FEATURES = ("ssd", "keep", "daemon", "budget", "codec", "compile_ops-off")
RANKED = ("ddp", "fsdp2", "compiled-ddp")


@dataclass(frozen=True, kw_only=True)
class ArmSpec:
    """``features``: offloadd's, explicit in the script (empty: the reference; under
    ``OFFLOADD=1`` the environment brings them). ``tools``: the user's. ``dirs``: a directory
    on disk for offload files and checkpoints; ``socket``: the daemon's, for ``daemon``."""

    features: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()
    dirs: str = ""
    socket: str = ""
    steps: int = STEPS
    breaks: bool = False
    """Graph breaks where relay's hooks are (no-op hooks hidden from dynamo): the reference of a
    relayed model compiled whole (Note [relay under torch.compile] in offloadd/relay/surface.py)."""

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "features": list(self.features), "tools": list(self.tools)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ArmSpec:
        return cls(**{**doc, "features": tuple(doc["features"]), "tools": tuple(doc["tools"])})


class Refused(Exception):
    """An arm that offloadd refused: its error's type and message."""


def _offloader_options(spec: ArmSpec) -> dict[str, Any] | None:
    feats = set(spec.features)
    if not feats & set(OFFLOADER_FEATURES):
        return None
    opts: dict[str, Any] = dict(
        tier="keep" if "keep" in feats else "ssd",
        min_bytes=4096,
        chunk_bytes=64 << 10,
        staging_bytes=1 << 20,
        prefetch_bytes=512 << 10,
        io_threads=2,
    )
    if opts["tier"] == "ssd":
        opts["ssd_dirs"] = [spec.dirs]
    if "daemon" in feats:
        opts["daemon"] = {"socket": spec.socket}
    if "budget" in feats:
        opts["budget"] = "1GiB"  # every plan fits: the plan is forced (_force_plan)
    if "codec" in feats:
        opts["codec"] = {"name": "int8", "min_bytes": 4096}
    if "compile_ops-off" in feats:
        opts["compile_ops"] = False
    return opts


@dataclass
class _Assembled:
    base: nn.Module  # the user's model (what state dicts see)
    outer: nn.Module  # the model as wrapped (DDP), what relay took
    fwd: Callable[..., Any]  # what the step calls: the model, wrapped, compiled
    opt: torch.optim.Optimizer
    trainable: list[nn.Parameter] = field(default_factory=list)


def _ckpt_mode(tools: tuple[str, ...]) -> str:
    for t in tools:
        if t.startswith("ckpt-") and t != "ckpt-file":
            return t.removeprefix("ckpt-")
    return ""


def _width(tools: tuple[str, ...]) -> int:
    # compiled DDP: wide enough for three buckets, whose graphs save different tensors (a
    # backward given another bucket's record of what its forward emptied crashed so)
    return 256 if "compiled-ddp" in tools else net.D


def _assemble(spec: ArmSpec, kind: str, seed: int = 0) -> _Assembled:
    base = net.build(kind, _ckpt_mode(spec.tools), seed, _width(spec.tools))
    tools, feats = set(spec.tools), set(spec.features)
    if "hf-gc" in tools:
        base.gradient_checkpointing_enable()  # type: ignore[operator]
    if "memsave" in feats:
        import offloadd

        offloadd.memsave(base)
    outer: nn.Module = base
    if "fsdp2" in tools:
        from torch.distributed.fsdp import fully_shard

        for layer in base.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(base)
    if "ddp" in tools or "compiled-ddp" in tools:
        from torch.nn.parallel import DistributedDataParallel

        cap = 1 if "compiled-ddp" in tools else 25  # MiB: three buckets under DDPOptimizer
        outer = DistributedDataParallel(base, bucket_cap_mb=cap)
    if feats & {"relay-ssd", "relay-cpu"}:
        import offloadd

        relay_opts: dict[str, Any] = dict(
            tier="cpu" if "relay-cpu" in feats else "ssd",
            ssd_dirs=[spec.dirs],
            chunk_bytes=64 << 10,
            io_threads=2,
        )
        if "daemon" in feats:
            relay_opts["daemon"] = {"socket": spec.socket}
        offloadd.relay(outer, **relay_opts)
    if spec.breaks:
        _break_like_relay(outer, base)
    fwd: Callable[..., Any] = outer
    if tools & {"compile-block-cold", "compile-block-warm"}:
        for layer in base.layers:  # type: ignore[union-attr]
            layer.compile()
    if tools & {"compile-whole-cold", "compile-whole-warm", "compiled-ddp"}:
        fwd = torch.compile(outer)
    trainable = [p for p in base.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.05, momentum=0.9)
    return _Assembled(base, outer, fwd, opt, trainable)


def _break_like_relay(outer: nn.Module, base: nn.Module) -> None:
    from offloadd.runtime.compiled import unseen

    noop = unseen(lambda *args: None)
    outer.register_forward_pre_hook(noop)
    outer.register_forward_hook(noop, always_call=True)
    for layer in base.layers:  # type: ignore[union-attr]
        layer.register_forward_pre_hook(noop)
        layer.register_forward_hook(noop, always_call=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor (FSDP2): this rank's shard
    return (to_local() if to_local is not None else t).detach().clone()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _local(v) for k, v in model.state_dict().items()}


def _did(spec: ArmSpec, off: Any, a: _Assembled, cache: Any) -> dict[str, Any]:
    """What offloadd did in this arm, per feature (the test requires each above zero)."""
    did: dict[str, float] = {}
    if off is not None:
        off.synchronize()
        st = off.stats()
        did.update(
            saved_tensors=st.saved_tensors,
            offloaded_bytes=st.offloaded_bytes,
            coded_tensors=st.coded_tensors,
        )
        did["planned"] = int(off.plan() is not None)
    if set(spec.features) & {"relay-ssd", "relay-cpu"}:
        import offloadd

        did["relay_read_bytes"] = offloadd.relay_stats(a.outer).read_bytes
    # memsave's classes, whether the script or OFFLOADD_MEMSAVE swapped them
    did["memsave_modules"] = sum(
        type(m).__module__.startswith("offloadd.memsave") for m in a.base.modules()
    )
    if cache is not None:
        did["host_cache_hits"] = cache.counters().hits
    return did


@contextlib.contextmanager
def _process_group(spec: ArmSpec) -> Iterator[int]:
    """This arm's rank: a gloo group for the ranked tools (torchrun's, or one of world size
    1 for compiled DDP), rank 0 otherwise."""
    if not set(spec.tools) & set(RANKED) or dist.is_initialized():
        yield dist.get_rank() if dist.is_initialized() else 0
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("gloo")
    try:
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()


def run(spec: ArmSpec) -> Trace:
    """Train as ``spec`` says; return the trace. offloadd's errors raise :class:`Refused`."""
    with contextlib.ExitStack() as stack:
        rank = stack.enter_context(_process_group(spec))
        try:
            return _train(spec, rank, stack)
        except Refused:
            raise
        except Exception as e:
            ours = type(e).__module__.startswith("offloadd") or str(e).startswith("offloadd")
            if spec.features and ours:
                raise Refused(f"{type(e).__name__}: {e}") from e
            raise
    raise AssertionError("unreachable")


class _Warnings(logging.Handler):
    """offloadd's warnings in this arm, for the cells that must say why a feature idled."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    handler = _Warnings()
    logger = logging.getLogger("offloadd")
    logger.addHandler(handler)
    try:
        yield handler.said
    finally:
        logger.removeHandler(handler)


def _train(spec: ArmSpec, rank: int, stack: contextlib.ExitStack) -> Trace:
    kind = "hf" if "hf-gc" in spec.tools else "net"
    said = stack.enter_context(_warnings())
    tools, feats = set(spec.tools), set(spec.features)
    cache = None
    if "host-cache" in feats:
        import offloadd

        cache = stack.enter_context(offloadd.host_cache())
    a = _assemble(spec, kind)
    off = None
    if (opts := _offloader_options(spec)) is not None:
        import offloadd

        off = offloadd.Offloader(**opts)
        stack.callback(off.close)
    scope: Callable[[], Any] = (lambda: off) if off is not None else contextlib.nullcontext
    amp: Callable[[], Any] = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if "autocast-bf16" in tools
        else contextlib.nullcontext
    )
    micro = 2 if "grad-accum" in tools else 1
    gen = torch.Generator().manual_seed(1 + rank)
    eval_x = net.batch(kind, torch.Generator().manual_seed(99))
    trace: Trace = {"losses": [], "grads": [], "rng": [], "eval": [], "state": []}
    first = {k: v.detach().clone() for k, v in a.base.state_dict().items()}  # DTensors stay
    trace["eval_first"] = _evaluate(kind, a, eval_x)
    for step in range(spec.steps):
        _force_plan(off, "budget" in feats)
        for _ in range(micro):
            x = net.batch(kind, gen)
            with scope(), amp():
                loss = net.loss_of(kind, a.fwd, x)
            (loss / micro).backward()
            trace["losses"].append(loss.detach().clone())
        trace["rng"].append(torch.get_rng_state())
        trace["grads"].append([_local(p.grad) for p in a.trainable if p.grad is not None])
        a.opt.step()
        a = _between_steps(spec, kind, a, step, trace, scope, eval_x)
    trace["final"] = _state(a.base)
    # Every cell ends as a run does: the first weights loaded back (best model at end),
    # evaluated (the same loss as before the first step), trained one more step.
    a.base.load_state_dict(first)
    trace["eval_loaded"] = _evaluate(kind, a, eval_x)
    assert torch.equal(trace["eval_loaded"], trace["eval_first"]), "loaded weights not used"
    with scope(), amp():
        loss = net.loss_of(kind, a.fwd, net.batch(kind, gen))
    loss.backward()
    trace["after_load"] = [loss.detach().clone(), *(_local(p.grad) for p in a.trainable)]
    trace["did"] = _did(spec, off, a, cache)
    trace["did"]["warnings"] = list(said)
    return trace


# Once the planner has planned (after its warm-up and profile steps), every decision at once,
# unraced: the first block recomputed, the second offloaded, the third kept, the head offloaded.
FORCED = ("recompute", "offload", "keep", "offload")


def _force_plan(off: Any, budget: bool) -> None:
    if not budget or off is None:
        return
    import dataclasses

    from tests._support.auto_train import set_plans

    set_plans(off, lambda p: dataclasses.replace(p, decisions=FORCED[-len(p.decisions) :]))


def _evaluate(kind: str, a: _Assembled, x: torch.Tensor) -> torch.Tensor:
    a.base.eval()
    try:
        with torch.no_grad():
            return net.loss_of(kind, a.fwd, x).detach().clone()
    finally:
        a.base.train()


def _between_steps(
    spec: ArmSpec,
    kind: str,
    a: _Assembled,
    step: int,
    trace: Trace,
    scope: Callable[[], Any],
    eval_x: torch.Tensor,
) -> _Assembled:
    tools = set(spec.tools)
    if "eval" in tools:
        trace["eval"].append(_evaluate(kind, a, eval_x))
        a.base.eval()
        with scope():  # a forward whose graph is dropped, inside the scope
            trace["eval"].append(net.loss_of(kind, a.fwd, eval_x).detach().clone())
        a.base.train()
    if "state-dict" in tools and step == 0:
        other = net.build(kind, _ckpt_mode(spec.tools), 7, _width(spec.tools)).state_dict()
        a.base.load_state_dict(other)
        trace["state"].append(_state(a.base))
    if "to" in tools:
        a.base.to("cpu")
        a.base.to(torch.float64)
        a.base.to(torch.float32)
    if "ckpt-file" in tools and step == 0:
        path = Path(spec.dirs) / f"seams-checkpoint-{os.getpid()}.pt"
        torch.save({"model": a.base.state_dict(), "opt": a.opt.state_dict()}, path)
        del a
        saved = torch.load(path, weights_only=True)
        path.unlink()
        a = _assemble(spec, kind, seed=11)  # other weights: the checkpoint must replace them
        a.base.load_state_dict(saved["model"])
        a.opt.load_state_dict(saved["opt"])
        return a  # the new optimizer has no gradients to zero
    if "grad-none-loop" in tools:
        for p in a.base.parameters():
            p.grad = None
    else:
        a.opt.zero_grad(set_to_none="zero-grad-keep" not in tools)
    return a
