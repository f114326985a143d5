"""The budget planner: profile one step, then keep, offload or recompute each block to fit.

Note: [auto] With ``Config.budget`` set, the offloader attaches an :class:`AutoPlanner` to the
first module called in its scope (the model) and finds its blocks (``discover.find_blocks``).
Module hooks on every block then tell the offloader, per block, whether what it saves is kept or
offloaded; what runs after the last block (the head and the loss, up to the end of the scope) is
one more unit of the plan, kept or offloaded, and what is saved before the first block
(embeddings) is kept. A block to recompute runs its forward under non-reentrant
``torch.utils.checkpoint`` with the RNG state preserved (recompute.py, [recompute wrapper]), so its
recomputation is bit-identical and so are the gradients. A block the profile saw change its inputs
or buffers in place (BatchNorm's running statistics) is never recomputed.

The first forward of each input shape (the shapes of the first block's arguments: sequence length,
batch size) warms caches and pools, and the second is a profile step (profile.py); both offload
every block, the memory-safe choice; when its backward has run, the next forward plans (solver.py,
[the plan]) and logs the plan as a table. Plans are kept per shape, so alternating shapes are
profiled once each. Where the allocator counts memory (see [measured peaks] in probe.py), the
budget bounds the step's measured activation peak, and planned steps are measured too (on CPU
every one; on CUDA, whose peak statistics are the user's as well, the first under each new plan);
without it, the budget bounds what offloadd holds (its own accounting). After a planned step the
planner checks its predictions: if the step used more than the budget (measured, or held: writes
in flight hold their tensors, and slower I/O holds more), it adds the excess to what every unit
needs and plans again (logged at WARNING), so the plan learns the worst it has seen; if the
blocks' forward time moved by more than 2x from the first planned step's for three steps in a row
(CPU only: CUDA is asynchronous), it profiles again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from torch import nn

from offloadd.auto import recompute
from offloadd.auto.discover import find_blocks
from offloadd.auto.probe import HostCacheProbe, MemoryProbe, open_probe
from offloadd.auto.profile import HEAD, StepProfile
from offloadd.auto.solver import (
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    BlockCost,
    InfeasibleBudget,
    Plan,
    plan_peak,
    solve,
)
from offloadd.runtime.ledger import Ledger
from offloadd.runtime.stats import format_bytes

__all__ = ["AutoPlanner", "plan_dict", "plan_table"]

log = logging.getLogger("offloadd")

_DRIFT = 2.0  # block forward time off the first planned step's by this factor (either way) ...
_DRIFT_STEPS = 3  # ... this many planned steps in a row: profile again
_STALE = 2  # forwards after a profile whose backward never completed: plan from it anyway


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        (tuple(a.shape), a.dtype, a.device.type)
        for a in (*args, *kwargs.values())
        if isinstance(a, torch.Tensor)
    )


class AutoPlanner:
    """Keep / offload / recompute per block under ``budget`` (see [auto]).

    ``budget``: bytes (int) or a fraction of keep's footprint (float). ``offload``: whether the
    tier can offload (False for tier keep). ``tls``: the offloader's thread-local, whose ``keep``
    and ``tag`` this sets around each block, and whose ``stack`` says a scope is open."""

    def __init__(self, budget: int | float, *, offload: bool, ledger: Ledger, tls: Any) -> None:
        self.budget = budget
        self.offload = offload
        self.ledger = ledger
        self.tls = tls
        self.root: nn.Module | None = None
        self.names: list[str] = []
        self.modules: list[nn.Module] = []
        self._index: dict[int, int] = {}
        self._handles: list[Any] = []
        # per shape: the profile's costs, its peak held (base) and its peak kept (kept base)
        self._costs: dict[tuple[Any, ...], tuple[list[BlockCost], int, int]] = {}
        self._ref_fwd: dict[tuple[Any, ...], float] = {}  # first planned step's block forward
        self._warm: set[tuple[Any, ...]] = set()  # shapes whose warm-up forward ran
        self.plans: dict[tuple[Any, ...], Plan] = {}
        self.plan: Plan | None = None  # of the forward running now (None: profiling or none)
        self.last_plan: Plan | None = None
        self._profile: StepProfile | None = None  # recording, or waiting for its backward
        self._recording = False
        self._first = True  # no block ran yet in this forward
        self._fwd_s = 0.0  # summed block forward time of this forward
        self._fwd_start: dict[int, float] = {}
        self._drifted = 0
        self._sig: tuple[Any, ...] | None = None
        self._prefix = False  # this forward began with a filled key/value cache
        self._prefix_warned = False
        self._planned: set[tuple[Any, ...]] = set()  # shapes that ever had a plan
        self._footprint: dict[tuple[Any, ...], int] = {}  # keep's, per shape, from its profile
        self.profiles = 0
        self.probe: MemoryProbe | None = None  # see [measured peaks] in probe.py
        self._level0 = 0  # the probe's level when this forward began
        self._verify = False  # a new plan: measure the next step that runs one
        self._armed = False  # this step is measured from its start

    # -- attaching ---------------------------------------------------------------------------

    def attach(self, root: nn.Module) -> None:
        """Find ``root``'s blocks and hook them (once; later calls do nothing)."""
        if self.root is not None:
            return
        self.root = root
        sample = next(root.parameters(), None)
        self.probe = open_probe(sample, lambda: self.ledger.stats.buffer_bytes)
        found = find_blocks(root)
        if not found:
            log.warning(
                "offloadd: budget: %s has no blocks to plan; offloading as usual",
                type(root).__name__,
            )
            self.tls.keep = False
            return
        for k, (name, m) in enumerate(found):
            self.names.append(name)
            self.modules.append(m)
            self._index[id(m)] = k
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, always_call=True))
            recompute.install(m, self, k)
        log.info(
            "offloadd: budget: %d blocks found (%s ... %s)", len(found), found[0][0], found[-1][0]
        )

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self.modules:
            recompute.remove(m)

    def __deepcopy__(self, memo: dict[int, Any]) -> AutoPlanner:
        # A deep copy of the model (EMA) copies the blocks' hooks, bound to this planner: the
        # copy shares it, and its hooks find no block of theirs (see [recompute wrapper]).
        return self

    def recompute_now(self, k: int) -> bool:
        """Whether block ``k``'s forward, being called now, runs under checkpointing."""
        plan = self.plan
        return (
            plan is not None
            and plan.decisions[k] == RECOMPUTE
            and not self._prefix
            and torch.is_grad_enabled()
            and self._scope_open()
            and not _in_backward()
        )

    def _scope_open(self) -> bool:
        return bool(getattr(self.tls, "stack", None))

    # -- the step ----------------------------------------------------------------------------

    def forward_begins(self) -> None:
        """An outermost scope opens: finish what the last step taught, then reset."""
        if self.plan is not None:
            self._check(self.plan)
        self._armed = False
        self.settle(forward=True)
        if self.probe is not None:
            # the host cache's window is offloadd's own: every step is measured; CUDA's peak
            # statistics are the user's too: only the first step under a new plan
            self._armed = self._verify or self.probe.name == HostCacheProbe.name
            self._level0 = self.probe.restart() if self._armed else self.probe.level()
        self.plan = None
        self._first = True
        self._fwd_s = 0.0
        with self.ledger.lock:
            st = self.ledger.stats
            self.ledger.window_peak = st.resident_bytes + st.buffer_bytes
            self.ledger.kept_peak = self.ledger.kept_now
        # Outside the blocks: kept (and before the model is known); without blocks: as usual.
        self.tls.keep = self.root is None or bool(self.modules)
        self.tls.tag = None

    def forward_ends(self) -> None:
        if self._recording and self._profile is not None:
            self._recording = False
            self._profile.forward_ends()

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        k = self._index.get(id(module))
        if k is None or _in_backward() or not self._scope_open() or not torch.is_grad_enabled():
            return
        if self._first:
            self._first = False
            self._prefix = recompute.cache_holds_prefix(args, kwargs)
            if self._prefix and not self._prefix_warned:
                self._prefix_warned = True
                log.warning(
                    "offloadd: budget: a key/value cache already holds tokens; forwards that "
                    "start with one are not recomputed (blocks planned for it are kept)"
                )
            self._begin_blocks(_signature(args, kwargs))
        plan = self.plan
        self.tls.keep = plan is not None and plan.decisions[k] != OFFLOAD
        if self._recording:
            assert self._profile is not None
            self.tls.tag = k
            if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
                torch.cuda.synchronize()
            self._profile.block_begins(k, args, kwargs, module)
        self._fwd_start[k] = time.perf_counter()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        k = self._index.get(id(module))
        if k is None or _in_backward() or not self._scope_open() or not torch.is_grad_enabled():
            return
        last = k == len(self.modules) - 1
        self.tls.keep = True  # between blocks
        self.tls.tag = None
        if last:  # what runs after the blocks: the plan's last unit (see [the plan])
            plan = self.plan
            self.tls.keep = plan is not None and plan.decisions[k + 1] != OFFLOAD
            self.tls.tag = k + 1 if self._recording else None
        start = self._fwd_start.pop(k, None)
        if self._recording:
            assert self._profile is not None
            if isinstance(output, torch.Tensor) and output.is_cuda:
                torch.cuda.synchronize()
            self._profile.block_ends(k, output, last=last, module=module)
        elif start is not None:
            self._fwd_s += time.perf_counter() - start

    def _begin_blocks(self, sig: tuple[Any, ...]) -> None:
        """The first block of a forward runs: use this shape's plan, or profile it."""
        self._sig = sig
        plan = self.plans.get(sig)
        if plan is not None:
            self.plan = self.last_plan = plan
            return
        if self._profile is not None:
            return  # a profile waits for its backward; this forward offloads every block too
        if sig not in self._warm:  # the first forward of a shape warms caches and pools
            self._warm.add(sig)
            return
        self._profile = StepProfile(
            [*self.names, HEAD], sig, self._io_wait, probe=self.probe, base_level=self._level0
        )
        self._recording = True
        self.profiles += 1

    @property
    def plan_offloads(self) -> bool | None:
        """Whether the last plan offloads any block (None before the first plan)."""
        plan = self.last_plan
        return None if plan is None else OFFLOAD in plan.decisions

    def saved(self, tag: int, nbytes: int) -> None:
        """The offloader saved a new storage of ``nbytes`` while block ``tag`` ran."""
        prof = self._profile
        if prof is not None and self._recording:
            prof.saved[tag] += nbytes

    def settle(self, *, forward: bool = False) -> None:
        """Plan from a profile whose backward has run (done at the next forward otherwise).

        A gradient that never reaches some block boundary (an output the loss does not use)
        would keep the profile waiting: after ``_STALE`` more forwards it is taken as it is, the
        missing backward times estimated as twice the forward's."""
        prof = self._profile
        if prof is None or self._recording:
            return
        if forward:
            prof.later_forwards += 1
        if prof.complete() or prof.later_forwards > _STALE:
            self._profile = None
            self._learn(prof)

    def _io_wait(self) -> float:
        return self.ledger.stats.io_wait_s

    # -- planning ----------------------------------------------------------------------------

    def _learn(self, prof: StepProfile) -> None:
        costs = prof.costs(kept=not self.offload)
        with self.ledger.lock:
            base, kept = self.ledger.window_peak, self.ledger.kept_peak
        if not self.offload:  # tier keep: the blocks' saved bytes were kept in the profile too
            kept = max(0, kept - sum(b.saved for b in costs))
            base = kept
        self._costs[prof.signature] = (costs, base, kept)
        # a fraction's bytes are fixed by the profile: replans that grow the base do not grow it
        floor = 0 if costs[0].measured else kept
        self._footprint[prof.signature] = plan_peak(costs, (KEEP,) * len(costs), floor)
        self._plan_for(prof.signature)

    def _plan_for(self, sig: tuple[Any, ...]) -> Plan:
        costs, base, kept = self._costs[sig]
        budget = self.budget
        nbytes = int(budget * self.keep_footprint(sig)) if isinstance(budget, float) else budget
        try:
            plan = solve(costs, base, nbytes, kept_base=kept, offload=self.offload)
        except InfeasibleBudget as e:
            if sig not in self._planned:  # the first plan for this shape: say so at once
                if isinstance(budget, float):  # in keep's terms too
                    raise InfeasibleBudget(nbytes, e.smallest, self.keep_footprint(sig)) from None
                raise
            # Planning again after a step held more than predicted: never stop a training run.
            log.warning("offloadd: %s; using the leanest plan", e)
            plan = solve(costs, base, e.smallest, kept_base=kept, offload=self.offload)
        if costs[0].measured and self.probe is not None:
            plan = dataclasses.replace(plan, measure=self.probe.name)
        self.plans[sig] = plan
        self._planned.add(sig)
        self.last_plan = plan
        self._verify = True
        log.info("offloadd: %s", plan_table(plan))
        return plan

    def _check(self, plan: Plan) -> None:
        """After a planned step: memory over budget -> plan again; time drift -> profile."""
        sig = self._sig
        if sig is None or sig not in self._costs:
            return
        costs, base, kept = self._costs[sig]
        held: int | None = None
        if not costs[0].measured:
            with self.ledger.lock:
                held = self.ledger.window_peak
        elif self._armed and self.probe is not None:  # measured from its start
            self._verify = False
            held = self.probe.peak() - self._level0
        if held is not None and held > plan.budget:
            over = held - plan.peak
            self._costs[sig] = (_shifted(costs, over), base + over, kept + over)
            log.warning(
                "offloadd: budget: the step used %s, over the budget of %s (predicted %s); "
                "planning again with every unit needing %s more",
                format_bytes(held),
                format_bytes(plan.budget),
                format_bytes(plan.peak),
                format_bytes(over),
            )
            self._plan_for(sig)
            return
        on_cpu = not torch.cuda.is_available() or not torch.cuda.is_initialized()
        if not on_cpu or self._fwd_s <= 0:
            return
        ref = self._ref_fwd.setdefault(sig, self._fwd_s)
        ratio = self._fwd_s / ref
        self._drifted = self._drifted + 1 if not 1 / _DRIFT < ratio < _DRIFT else 0
        if self._drifted >= _DRIFT_STEPS:
            self._drifted = 0
            log.info(
                "offloadd: budget: block forward times drifted (%.2fx the first planned "
                "step's); profiling again",
                ratio,
            )
            del self.plans[sig], self._costs[sig], self._ref_fwd[sig]

    def keep_footprint(self, sig: tuple[Any, ...] | None = None) -> int:
        """Keep's predicted footprint for shape ``sig`` (default: the last profiled): the peak
        kept in the profile step plus every block's saved bytes."""
        if sig is None:
            sig = next(reversed(self._footprint))
        return self._footprint[sig]


def _shifted(costs: list[BlockCost], over: int) -> list[BlockCost]:
    """``costs`` with every measured peak and level ``over`` bytes higher."""
    return [
        dataclasses.replace(
            b,
            peak_fwd=(b.peak_fwd or 0) + over,
            peak_bwd=(b.peak_bwd or 0) + over,
            level_bwd=(b.level_bwd or 0) + over,
        )
        if b.measured
        else b
        for b in costs
    ]


def plan_table(plan: Plan) -> str:
    """The plan as the table logged at INFO: block, bytes, decision, predicted times."""
    how = "held by offloadd" if plan.measure == "held" else f"measured by {plan.measure}"
    head = (
        f"plan for a budget of {format_bytes(plan.budget)}: predicted peak "
        f"{format_bytes(plan.peak)} ({how}; base {format_bytes(plan.base)}), "
        f"+{plan.extra_s * 1e3:.1f} ms per step over keeping every block; "
        f"{plan.count('keep')} keep, {plan.count(OFFLOAD)} offload, "
        f"{plan.count(RECOMPUTE)} recompute"
    )
    rows = [
        f"  {'block':<24} {'saved':>10} {'inputs':>10} {'fwd peak':>10} {'bwd peak':>10} "
        f"{'fwd ms':>8} {'bwd ms':>8} {'io ms':>7}  {'decision':<10} {'+ms':>6}"
    ]
    for k, (b, d) in enumerate(zip(plan.blocks, plan.decisions, strict=True)):
        pf = format_bytes(b.peak_fwd) if b.peak_fwd is not None else "-"
        pb = format_bytes(b.peak_bwd) if b.peak_bwd is not None else "-"
        rows.append(
            f"  {b.name:<24} {format_bytes(b.saved):>10} {format_bytes(b.inputs):>10} "
            f"{pf:>10} {pb:>10} "
            f"{b.forward_s * 1e3:>8.1f} {b.backward_s * 1e3:>8.1f} {b.offload_s * 1e3:>7.1f}  "
            f"{d:<10} {plan.extra_of(k) * 1e3:>6.1f}"
        )
    return "\n".join([head, *rows])


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan for the JSON report."""
    return {
        "budget_bytes": plan.budget,
        "base_bytes": plan.base,
        "predicted_peak_bytes": plan.peak,
        "predicted_extra_s": plan.extra_s,
        "measure": plan.measure,
        "blocks": [
            {
                "name": b.name,
                "saved_bytes": b.saved,
                "input_bytes": b.inputs,
                "forward_s": b.forward_s,
                "backward_s": b.backward_s,
                "offload_s": b.offload_s,
                "peak_fwd_bytes": b.peak_fwd,
                "peak_bwd_bytes": b.peak_bwd,
                "decision": d,
                "predicted_extra_s": plan.extra_of(k),
            }
            for k, (b, d) in enumerate(zip(plan.blocks, plan.decisions, strict=True))
        ],
    }
