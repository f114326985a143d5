"""The seams grid: offloadd's features, the users' tools, and the cells they make.

A **cell** is a pair: one of offloadd's features with one of the users' tools, or two of
offloadd's features (on different axes) in eager mode. Every cell trains the same small model
with the pair and without offloadd (the reference, with the same tool), and must give
bit-identical losses, gradients, RNG use, observations between steps and final weights (the
codec: finite, within its documented error), with each feature having done its work; or be
refused by offloadd with an error that names both sides (``refused``: the words the message must
hold); docs/compose.md shows the grid (``markdown()``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

__all__ = [
    "CELLS",
    "FEATURES",
    "IDLE",
    "NOT_CELLS",
    "SAMPLE",
    "TOOLS",
    "Cell",
    "Feature",
    "Tool",
    "breaks",
    "mark",
    "markdown",
    "refused",
]


@dataclass(frozen=True)
class Feature:
    name: str
    what: str
    axis: str
    """Features on one axis are alternatives, never paired with each other."""
    env: dict[str, str] | None = field(default_factory=dict)
    """How ``OFFLOADD=1`` spells it (``None``: it has no spelling there)."""
    did: str = "offloaded_bytes"
    """What must be above zero after the arm (``_did`` in arm.py; the report's stats for env)."""
    exact: bool = True
    cuda: bool = False


@dataclass(frozen=True)
class Tool:
    name: str
    what: str
    process: str = ""
    """Where an arm runs: in the test's process (``""``), or in its own (``"cold"``: a fresh
    inductor cache; ``"warm"``: a cache that runs without and with offloadd filled; ``"group"``:
    a gloo group of world size 1; ``"ranks"``: two ranks under torchrun)."""


FEATURES = (
    Feature("ssd", "tier `ssd`, the defaults (`compile_ops` on, the host cache on CPU)", "tier"),
    Feature("keep", "tier `keep`: the hooks, nothing moved", "tier", {"OFFLOADD_TIER": "keep"}, did="saved_tensors"),
    Feature("daemon", "tier `ssd` through a real `offloadd serve`", "backend", {"OFFLOADD_DAEMON_SOCKET": "{socket}"}),
    Feature("budget", "`budget`: a plan recomputing, offloading and keeping blocks", "budget", {"OFFLOADD_BUDGET": "1GiB"}, did="planned"),
    Feature("codec", "codec `int8` (lossy: finite, within its error)", "codec", {"OFFLOADD_CODEC_NAME": "int8", "OFFLOADD_CODEC_MIN_BYTES": "4096"}, did="coded_tensors", exact=False),
    Feature("memsave", "`memsave(model)`", "memsave", {"OFFLOADD_MEMSAVE": "1"}, did="memsave_modules"),
    Feature("relay-ssd", "`relay(model)`, the ssd store", "relay", {"OFFLOADD_RELAY": "frozen"}, did="relay_read_bytes"),
    Feature("relay-cpu", "`relay(model)`, the pinned host store (a GPU)", "relay", None, did="relay_read_bytes", cuda=True),
    Feature("compile_ops-off", "tier `ssd` with `compile_ops = false`", "compile_ops", {"OFFLOADD_COMPILE_OPS": "0"}, did="saved_tensors"),
    Feature("host-cache", "`offloadd.host_cache()` around training", "host_cache", None, did="host_cache_hits"),
    Feature("env", "`OFFLOADD=1` in an unmodified script (tier `ssd`)", "activation"),
)  # fmt: skip

TOOLS = (
    Tool("eager", "eager, plain SGD with momentum"),
    Tool("compile-whole-cold", "`torch.compile(model)`, cold inductor cache", "cold"),
    Tool("compile-whole-warm", "`torch.compile(model)`, the cache warm from runs with and without offloadd", "warm"),
    Tool("compile-block-cold", "`block.compile()` per block, cold cache", "cold"),
    Tool("compile-block-warm", "`block.compile()` per block, warm cache", "warm"),
    Tool("compiled-ddp", "`torch.compile(DDP(model))`: DDPOptimizer's buckets, cold cache", "group"),
    Tool("ddp", "DDP, 2 gloo ranks under torchrun", "ranks"),
    Tool("fsdp2", "FSDP2 (`fully_shard` per block and the model), 2 gloo ranks", "ranks"),
    Tool("ckpt-non-reentrant", "`torch.utils.checkpoint` per block, non-reentrant"),
    Tool("ckpt-reentrant", "`torch.utils.checkpoint` per block, reentrant"),
    Tool("ckpt-sac", "selective checkpointing per block (matmuls saved)"),
    Tool("hf-gc", "HF Llama with `gradient_checkpointing_enable()`"),
    Tool("autocast-bf16", "`torch.autocast('cpu', torch.bfloat16)`"),
    Tool("grad-accum", "gradient accumulation, 2 micro-batches a step"),
    Tool("state-dict", "`load_state_dict()` of other weights after step 1, `state_dict()`"),
    Tool("eval", "an eval pass between steps (`no_grad`, and a forward whose graph is dropped)"),
    Tool("to", "`.to('cpu')`, `.to(float64)`, `.to(float32)` between steps"),
    Tool("zero-grad-keep", "`zero_grad(set_to_none=False)`"),
    Tool("grad-none-loop", "`for p in model.parameters(): p.grad = None`"),
    Tool("ckpt-file", "`torch.save` model and optimizer, a new model loads them, training goes on"),
)  # fmt: skip

_FEATURE = {f.name: f for f in FEATURES}
_TOOL = {t.name: t for t in TOOLS}

# Pairs that are no cell, and why (shown in docs/compose.md).
NOT_CELLS: dict[frozenset[str], str] = {
    frozenset({"keep", "daemon"}): "tier `keep` moves nothing: it opens no backend",
    frozenset({"env", "host-cache"}): "`host_cache()` is a call in the script; under `OFFLOADD=1` tier `ssd` installs the host cache on CPU itself (the `env` row)",
}  # fmt: skip


@dataclass(frozen=True)
class Cell:
    features: tuple[str, ...]
    tool: str = "eager"

    @property
    def id(self) -> str:
        return "+".join(self.features) + "-x-" + self.tool

    @property
    def tools(self) -> tuple[str, ...]:
        """The arm's tools (eager: none)."""
        return () if self.tool == "eager" else (self.tool,)

    @property
    def process(self) -> str:
        p = _TOOL[self.tool].process
        return p or ("env" if "env" in self.features else "")

    @property
    def exact(self) -> bool:
        return all(_FEATURE[f].exact for f in self.features)

    @property
    def cuda(self) -> bool:
        return any(_FEATURE[f].cuda for f in self.features)

    def feature(self, name: str) -> Feature:
        return _FEATURE[name]


def _cells() -> tuple[Cell, ...]:
    cells = [Cell((f.name,), t.name) for f in FEATURES for t in TOOLS]
    for a, b in itertools.combinations(FEATURES, 2):
        if a.axis == b.axis or frozenset({a.name, b.name}) in NOT_CELLS:
            continue
        if "env" in (a.name, b.name) and (a.env is None or b.env is None):
            continue  # no spelling under OFFLOADD=1: relay-cpu (the GPU's) alone
        compiled = "compile_ops-off" in (a.name, b.name)  # it matters under compile only
        cells.append(Cell((a.name, b.name), "compile-whole-cold" if compiled else "eager"))
    return tuple(cells)


CELLS = _cells()

_WHOLE = ("compile-whole-cold", "compile-whole-warm", "compiled-ddp")  # a model compiled whole


def refused(cell: Cell) -> tuple[str, ...] | None:
    """The words offloadd's error must hold where it refuses the cell (both sides named, and
    what to do), else None."""
    features, tool = set(cell.features), cell.tool
    if features & {"relay-ssd", "relay-cpu"} and tool == "fsdp2":
        # FSDP2's weights are DTensor shards, gathered from FSDP2's own buffers
        return ("offloadd relay:", "DTensor", "FSDP2", "relay a model that is not sharded")
    if "codec" in features and tool in _WHOLE:
        # a compiled region's saves reach pack without the op that saved them, which it needs
        return ("codec.name='int8' does not run under torch.compile", "codec.name='none'")
    if "budget" in features and tool in _WHOLE:
        # ... and all at once: no block of it can be kept, offloaded or recomputed apart
        return ("does not plan a model compiled whole", "block.compile()", "budget='off'")
    return None


# Cells whose reference breaks the graph where offloadd does, and the warning that says it does.


def breaks(cell: Cell) -> tuple[str, ...] | None:
    """For a relayed model compiled whole (Note [relay under torch.compile]): the warning's
    words; the reference is the model compiled with graph breaks at relay's hooks."""
    if cell.tool in _WHOLE and {"relay-ssd", "relay-cpu"} & set(cell.features):
        return ("offloadd relay:", "compiled whole", "layer.compile()")
    return None


# Cells where a feature has nothing to do, and the warning that must say so instead.
IDLE: dict[str, tuple[str, ...]] = {
    # reentrant checkpointing runs the blocks under no_grad: nothing in them is saved, so
    # nothing there to plan; the checkpoints' inputs between them are kept
    "budget-x-ckpt-reentrant": ("budget:", "checkpoints its blocks itself", "turn the model's checkpointing off"),
}  # fmt: skip

# The default run's cells (the rest are marked slow): every tool of the test's own process
# once, each with another feature in turn, and every feature in eager mode and with another
# feature; the subprocess tools in the slow set only, beside their own tests (compiled DDP:
# tests/runtime/test_compile_ddp.py; OFFLOADD=1: tests/integrations/).
_IN_PROCESS = [t.name for t in TOOLS if not t.process]
_ROTATION = [f.name for f in FEATURES if not f.cuda and f.name != "env"]
# The cells that found a defect, kept in the default run.
FOUND = (
    "budget-x-ckpt-non-reentrant",  # the planner recomputed inside the model's checkpoint
    "budget-x-hf-gc",  # ... and inside transformers' gradient checkpointing
    "budget-x-ckpt-reentrant",  # the budget idled without a word
    "budget-x-ckpt-file",  # the planner kept planning the model a checkpoint replaced
    "relay-ssd-x-hf-gc",  # groups left swapped in, guarded: the loaded weights went unused
    "budget+relay-ssd-x-eager",  # ... the same, by the planner's recomputation
    "relay-ssd-x-grad-none-loop",  # p.grad = None raised
)
# ... and those that run in processes of their own, in the slow set (each has a test of its own
# in the default run): compiled DDP (tests/runtime/test_compile_ddp.py), relay and FSDP2, relay
# compiled whole (tests/relay/test_relay_compose.py::test_compiled).
FOUND_SLOW = ("ssd-x-compiled-ddp", "relay-ssd-x-fsdp2", "relay-ssd-x-compile-whole-cold")
SAMPLE = frozenset(
    [*FOUND]
    + [Cell((f,), "eager").id for f in _ROTATION]
    + [Cell((_ROTATION[i % len(_ROTATION)],), t).id for i, t in enumerate(_IN_PROCESS[1:], 1)]
    + [c.id for c in CELLS if len(c.features) == 2 and c.tool == "eager" and "env" not in c.features][::3]
)  # fmt: skip


def mark(cell: Cell) -> str:
    """What a cell must give, in one sign (the legend is in docs/compose.md)."""
    if cell.cuda:
        return "GPU"
    if refused(cell) is not None:
        return "refused"
    if cell.id in IDLE:
        return "idle, warned"
    if breaks(cell) is not None:
        return "exact, breaks, warned"
    return "exact" if cell.exact else "within error"


def markdown() -> str:
    """The grid as docs/compose.md shows it: a row per tool and a column per feature, then the
    pairs of features (in eager mode; with ``compile_ops-off``, compiled whole)."""
    named = list(FEATURES)
    by_id = {c.id: c for c in CELLS}
    rows = ["| tool \\ feature | " + " | ".join(f"`{f.name}`" for f in named) + " |"]
    rows.append("|---" * (len(named) + 1) + "|")
    for t in TOOLS:
        marks = [mark(by_id[Cell((f.name,), t.name).id]) for f in named]
        rows.append(f"| `{t.name}` | " + " | ".join(marks) + " |")
    rows += ["", "| feature \\ feature | " + " | ".join(f"`{f.name}`" for f in named[1:]) + " |"]
    rows.append("|---" * len(named) + "|")
    pairs = {frozenset(c.features): c for c in CELLS if len(c.features) == 2}
    for i, a in enumerate(named[:-1]):
        marks = []
        for b in named[1:]:
            cell = pairs.get(frozenset({a.name, b.name}))
            if named.index(b) <= i:
                marks.append("")
            elif cell is not None:
                marks.append(mark(cell))
            elif a.axis == b.axis:
                marks.append("(one axis)")
            else:
                marks.append("(no cell)")
        rows.append(f"| `{a.name}` | " + " | ".join(marks) + " |")
    return "\n".join(rows)
