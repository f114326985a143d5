"""A training run traced on fake tensors: the model built and trained for a few steps as the
harness trains it (tools/harness/train.py: AdamW, gradients and optimizer state made before the
first step), every storage noted (live.py). Nothing is computed and no memory is used, so a
model of any size traces on a laptop in seconds.

Offloading is traced as an ideal offloader would run: a saved tensor that offloadd would move
(as its pack decides: not a parameter or a view of one, at least ``min_bytes`` of its own) leaves
memory when packed, one copy of its storage however many tensors share it, and comes back at its
first unpack, freed after its last.
offloadd's prefetch window and staging buffers are not in it: measured on the wall they stay
inside the prediction's error (docs/benchmarks/, the wall page). Writes held behind a slow disk
are not either, and can pass it: they are predicted beside it (Note [writes behind a slow disk]
in peak.py).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from offloadd.auto.discover import find_blocks
from offloadd.config import Config
from offloadd.runtime.identity import is_parameter
from offloadd.tools.models.build import build_model
from offloadd.tools.predict.live import Event, LiveBytes

__all__ = ["OPTIMIZERS", "STAND_INS", "TRACED", "Traced", "TraceSpec", "trace"]

TRACED = ("plain", "recompute", "sac", "offload", "compile-budget")
"""What can be traced: no hooks, every block checkpointed, selective checkpointing, offloaded,
and compiled whole under torch.compile's recompute planner (see [a compiled run traced])."""

OPTIMIZERS = ("adamw", "adam", "sgd", "none")


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceSpec:
    """The model, as tools/models/build.py builds it, and how it trains."""

    model: str = "gpt"
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    vocab: int | None = None
    hf_config: str | None = None
    optimizer: str = "adamw"
    dtype: str = "float32"  # the parameters'
    steps: int = 3  # the wall's point: 1 warm-up and 2 timed steps
    min_bytes: int = 1 << 20  # offload: the Config's
    # offload: the Config's, what writes behind a slow disk may hold (Prediction.writes_bytes)
    staging_bytes: int = Config().staging_bytes


@dataclass(frozen=True, slots=True)
class Traced:
    """One traced run: its events, its peak of live bytes, and what was live at the end by
    phase (``build``: the weights; ``state``: gradients and optimizer state)."""

    events: list[Event]
    peak: int
    held: dict[str, int]
    blocks: int  # the blocks auto's planner finds in the model (auto/discover.py)


def trace(
    spec: TraceSpec, strategy: str, batch: int, seq: int, *, kept: tuple[bool, ...] = ()
) -> Traced:
    """Trace ``strategy`` (one of TRACED) at ``batch`` x ``seq``. ``kept``: offload as auto's
    plan does, a decision per block and one for what runs after the blocks (``_Plan``)."""
    if strategy not in TRACED:
        raise ValueError(f"strategy must be one of {', '.join(TRACED)}, got {strategy!r}")
    if kept and strategy != "offload":
        raise ValueError(f"a plan (kept) is traced with offload only, not {strategy!r}")
    if spec.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {spec.optimizer!r}"
        )
    compiled = strategy == "compile-budget"
    live = (_CompiledLiveBytes if compiled else LiveBytes)(STAND_INS)
    backend = _Partitioned() if compiled else None
    with FakeTensorMode(), live, _planner() if compiled else contextlib.nullcontext():
        torch.manual_seed(0)
        built = build_model(
            spec.model,
            num_layers=spec.layers,
            d_model=spec.hidden,
            num_heads=spec.heads,
            seq_len=seq,
            vocab_size=spec.vocab,
            recompute=strategy in ("recompute", "sac"),
            selective=strategy == "sac",
            compile=backend or False,
            hf_config=spec.hf_config,
        )
        if spec.dtype != "float32":  # as the harness does, after building
            built.module.to(dtype=getattr(torch, spec.dtype))
        params = list(built.module.parameters())
        live.phase = "state"
        opt = _optimizer(spec.optimizer, params)
        for p in params:
            p.grad = torch.zeros_like(p)
        if opt is not None:
            opt.step()
        live.phase = "step"
        offload = strategy == "offload"
        blocks = find_blocks(built.module)
        plan = _Plan(blocks, kept) if kept else None
        for _ in range(spec.steps):
            x = torch.randint(0, built.vocab_size, (batch, seq + 1))
            if plan is not None:
                plan.now = True
            with (
                _offloaded(params, spec.min_bytes, keeping=plan)
                if offload
                else contextlib.nullcontext()
            ):
                loss = built.loss(x[:, :-1], x[:, 1:])
            loss.backward()
            del loss, x
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=False)
        held = live.live_by_phase()
    if backend is not None and not backend.graphs:  # dynamo skipped every frame: ran eager
        raise RuntimeError(
            f"compile-budget: torch.compile compiled no graph of the model under the trace "
            f"(torch {torch.__version__}); its peak is not predicted"
        )
    return Traced(list(live.events), live.peak, held, len(blocks))


class _Plan:
    """auto's plan in a trace: what block ``k`` saves is kept where ``kept[k]``, else offloaded;
    what runs after the blocks (the head and the loss) by ``kept[-1]``; what is saved before the
    first block and between blocks is kept, as the planner keeps it (Note [auto] in
    offloadd/auto/planner.py). Called: whether what is saved now is kept."""

    def __init__(self, blocks: list[tuple[str, torch.nn.Module]], kept: tuple[bool, ...]) -> None:
        if len(kept) != len(blocks) + 1:
            raise ValueError(f"a plan has {len(blocks) + 1} decisions here, not {len(kept)}")
        self.kept = kept
        self.now = True
        for k, (_, m) in enumerate(blocks):
            m.register_forward_pre_hook(functools.partial(self._pre, k))
            m.register_forward_hook(functools.partial(self._post, k))

    def _pre(self, k: int, *_: Any) -> None:
        self.now = self.kept[k]

    def _post(self, k: int, *_: Any) -> None:
        self.now = self.kept[-1] if k == len(self.kept) - 2 else True

    def __call__(self) -> bool:
        return self.now


def _grouped_mm(*args: Any, **kwargs: Any) -> Any:
    """aten._grouped_mm on fake tensors of any float type: its meta function takes bfloat16
    only, while the CPU kernel (a mixture of experts' layers in transformers) takes float32 too.
    The output's shape is the same; its dtype is the inputs'."""
    dtype = args[0].dtype
    cast = [
        a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    ]
    out: torch.Tensor = torch.ops.aten._grouped_mm.default(*cast, **kwargs)
    return out.to(dtype)


STAND_INS = {torch.ops.aten._grouped_mm.default: _grouped_mm}
"""Ops whose fake-tensor implementation refuses what the real kernel runs."""


# Note [a compiled run traced]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# compile-budget's run is traced through torch.compile itself: dynamo captures the same graphs
# (and breaks) on fake tensors, and AOTAutograd partitions each joint graph as inductor does
# (its decompositions and joint-graph passes, then the min-cut partitioner under the run's
# ``activation_memory_budget``), so the forward saves what the real run's saves. The
# partitioned graphs then run as FX code, which frees each value after its last use. Inductor
# fuses ops, so it makes fewer temporaries than that: the trace's temporaries read above
# inductor's, its saved bytes the same. (Leaving out a pointwise op's output where its users
# are all pointwise, as inductor fuses them, moved the prediction further from the wall's
# measured peaks, and is not done.) LiveBytes is off while dynamo compiles
# (``ignore_compile_internals``) and on while the graphs run. What the compiler itself holds is
# measured apart (``compiler_bytes`` in peak.py).


class _CompiledLiveBytes(LiveBytes):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


@contextlib.contextmanager
def _planner() -> Iterator[None]:
    """compile-budget's partitioner settings, and dynamo's caches emptied around the trace (each
    point of the wall compiles afresh, with static shapes)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    from offloadd.tools.harness.peers import COMPILE_MEMORY_BUDGET

    torch._dynamo.reset()
    try:
        with functorch_config.patch(activation_memory_budget=COMPILE_MEMORY_BUDGET):
            yield
    finally:
        torch._dynamo.reset()


class _Partitioned:
    """A torch.compile backend that partitions as inductor does (its joint-graph passes, then
    the min-cut partitioner) and runs the graphs as FX; ``graphs`` counts those it was given."""

    def __init__(self) -> None:
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        self.graphs = 0
        self.backend = aot_autograd(
            fw_compiler=self.as_fx,
            bw_compiler=self.as_fx,
            partition_fn=self.partition,
            decompositions=select_decomp_table(),
        )

    @staticmethod
    def partition(gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.virtualized import V

        with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # as inductor's compile sets it
            return partition_fn(gm, joint_inputs, **kwargs)

    def as_fx(self, gm: torch.fx.GraphModule, example: Any) -> Any:
        from functorch.compile import make_boxed_func

        self.graphs += 1
        return make_boxed_func(gm)

    def __call__(self, gm: torch.fx.GraphModule, example: Any) -> Any:
        return self.backend(gm, example)


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return None


_numbers = itertools.count()


@contextlib.contextmanager
def _offloaded(
    params: list[torch.nn.Parameter],
    min_bytes: int,
    brought: list[int] | None = None,
    *,
    keeping: Callable[[], bool] | None = None,
) -> Iterator[None]:
    """Saved-tensor hooks that drop what offloadd would move and make it again when unpacked
    (``brought``: each copy back's bytes are appended to it; ``keeping``: whether a plan keeps
    what is saved now)."""
    kept = {p.untyped_storage()._cdata for p in params}
    # A storage's address is reused once it is freed, so an offloaded one is known by a weak
    # reference to it while it lives, and by a number of its own after.
    known: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
    away: dict[int, list[Any]] = {}  # number -> [unpacks left, its copy back or None, bytes]

    def pack(t: torch.Tensor) -> Any:
        # what offloadd's pack keeps (runtime/hooks.py): a parameter or a view of one, a
        # tensor below min_bytes (its own bytes: a small view holds its whole storage), a
        # sparse or empty one; kept detached where it has a grad_fn, as offloadd keeps it (an
        # op's output saved by that op would hold its own graph, never freed if the graph is
        # dropped without a backward: Note [passed on detached] in relay/backward.py)
        if (
            t.layout is not torch.strided
            or not t.nbytes
            or t.nbytes < min_bytes
            or (keeping is not None and keeping())
            or t.untyped_storage()._cdata in kept
            or is_parameter(t)
        ):
            return t if t.is_leaf else t.detach()
        st = t.untyped_storage()
        ref, key = known.get(st._cdata, (None, -1))
        if ref is None or ref() is not st:
            key = next(_numbers)
            known[st._cdata] = (weakref.ref(st), key)
        entry = away.setdefault(key, [0, None, st.nbytes()])
        entry[0] += 1
        return (key, t.shape, t.stride(), t.dtype, t.storage_offset())

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        key, shape, stride, dtype, offset = packed
        entry = away[key]
        if entry[1] is None:  # whole 16-byte words, for a view of any dtype
            entry[1] = torch.empty(-(-entry[2] // 16) * 16, dtype=torch.uint8)
            if brought is not None:
                brought.append(entry[2])
        back = entry[1]
        entry[0] -= 1
        if entry[0] == 0:
            del away[key]
        out: torch.Tensor = back.view(dtype).as_strided(shape, stride, offset)
        return out

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
