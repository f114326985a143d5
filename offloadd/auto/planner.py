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
every one; on CUDA, whose peak statistics are the user's as well, the first under each new plan),
from the forward's start until backward's gradient reaches the first block's input: what runs
between steps (an evaluation, another model's step) is not the step's;
without it, the budget bounds what offloadd holds (its own accounting). After a planned step the
planner checks its predictions: if the step used more than the budget (measured, or held: what
writes in flight hold is capped at the plan's room, Note [room for writes]), it adds the excess to what every unit
needs and plans again (logged at WARNING), so the plan learns the worst it has seen; if the
blocks' forward time moved by more than 2x from the second planned step's (the first warms
caches) for three steps in a row (drift.py), it profiles again. The first plan for a shape then races
offloading every block in real steps until it tells them apart (race.py, [race]), which decides
what offloading costs here: ``WARMUP_STEPS`` to ``WARMUP_STEPS_MAX`` steps in all before the plan
is final (more where a replan, a re-profile or another shape restarts the race).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from offloadd.auto import recompute
from offloadd.auto.drift import Drift
from offloadd.auto.grad_hooks import GradHooks, weakly
from offloadd.auto.planned import PlannedModel
from offloadd.auto.plans import ShapePlans
from offloadd.auto.probe import CudaProbe, HostCacheProbe, MemoryProbe, open_probe
from offloadd.auto.profile import HEAD, StepProfile, first_grad_tensor
from offloadd.auto.race import PATIENCE, RACE_STEPS_MAX, RACE_STEPS_MIN, Race
from offloadd.auto.solver import OFFLOAD, RECOMPUTE, Plan
from offloadd.runtime.hook_stack import saves_reach_offloadd
from offloadd.runtime.stages import PlannerView

__all__ = ["WARMUP_STEPS", "WARMUP_STEPS_MAX", "AutoPlanner"]

log = logging.getLogger("offloadd")

_STALE = 2  # forwards after a profile whose backward never completed: plan from it anyway
WARMUP_STEPS = 3 + RACE_STEPS_MIN
"""Steps of one shape before its final plan has run once, at the least: the warm-up forward, the
profile, the race ([race]) and the first step under the final plan (its allocations warm the
caches)."""
WARMUP_STEPS_MAX = 3 + RACE_STEPS_MAX
"""The same with the longest race."""


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
    tier can offload (False for tier keep). ``view``: what it sees of the runtime and sets for
    each block (:class:`~offloadd.runtime.stages.PlannerView`)."""

    def __init__(self, budget: int | float, *, offload: bool, view: PlannerView) -> None:
        self.budget = budget
        self.offload = offload
        self.view = view
        self.model = PlannedModel()  # planned.py
        self._grad_hooks = GradHooks()  # see [one hook per tensor] in grad_hooks.py
        self.shapes = ShapePlans(budget, offload)  # plans.py
        # Drift's reference: the block forward time of a shape's second planned step (the first
        # warms caches to the plan's allocations, so on small blocks it is the slowest: drift.py)
        self.drift = Drift()  # block forward times against each shape's planned ones
        self._warm: set[tuple[Any, ...]] = set()  # shapes whose warm-up forward ran
        self.plan: Plan | None = None  # of the forward running now (None: profiling or none)
        self.last_plan: Plan | None = None
        self._profile: StepProfile | None = None  # recording, or waiting for its backward
        self._recording = False
        self._first = True  # no block ran yet in this forward
        self._fwd_s = 0.0  # summed block forward time of this forward
        self._fwd_start: dict[int, float] = {}
        self._sig: tuple[Any, ...] | None = None
        self._prefix = False  # this forward began with a filled key/value cache
        self._prefix_warned = False
        self.profiles = 0
        self.probe: MemoryProbe | None = None  # see [measured peaks] in probe.py
        self._level0 = 0  # the probe's level when this forward began
        self._verify = False  # a new plan: measure the next step that runs one
        self._armed = False  # this step is measured from its start
        self._step_peak: int | None = None  # the probe's peak when its backward got to block 0
        self._step_no = 0  # forwards begun: a late backward's mark is not this step's
        self._step_t0 = 0.0  # when this forward began
        self.clock = time.perf_counter  # of step times, for races (tests give it a fake)
        self._checkpointed_warned = False
        self._replan = False  # a recomputation differed: plan every shape again

    # -- attaching ---------------------------------------------------------------------------

    @property
    def root(self) -> nn.Module | None:
        """The model planned (held weakly: planned.py)."""
        return self.model.root

    @property
    def names(self) -> list[str]:
        return self.model.names

    def attach(self, root: nn.Module) -> None:
        """Plan ``root`` (once per model: while the model planned lives, later calls do
        nothing; once it is gone, what was learned of it goes too)."""
        if self.model.root is not None:
            return
        if self.model.gone:  # what was learned of it goes too
            self.detach()
            self.model, self.drift = PlannedModel(), Drift()
            self.shapes = ShapePlans(self.budget, self.offload)
            self._warm, self.plan, self.last_plan, self._profile = set(), None, None, None
            log.info("offloadd: budget: the model planned is gone; planning the next one")
        view, planned = self.view, self.model  # not self: shapes is the planner's own
        self.shapes.held = lambda: view.held_elsewhere(planned.root)
        sample = next(root.parameters(), None)
        # the view's method, not the planner's: what a user's tensor holds must not keep it
        self.probe = open_probe(sample, self.view.buffer_bytes)
        if not self.model.hook(root, self):
            self.view.set_keep(False)

    def detach(self) -> None:
        self.model.unhook()
        self._grad_hooks.clear()

    def plans_within(self, module: nn.Module) -> bool:
        root = self.model.root
        if root is None:
            return True  # the first module noted is the one planned
        inside = {id(m) for m in module.modules()}
        blocks = (ref() for ref in self.model.modules)
        return id(root) in inside or any(b is not None and id(b) in inside for b in blocks)

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
            and k not in self.shapes.never
            and not self._prefix
            and torch.is_grad_enabled()
            and self._scope_open()
            and not _in_backward()
            and saves_reach_offloadd()  # not inside the model's own checkpoint: [innermost hooks]
        )

    def never_recompute(self, k: int) -> None:
        """Block ``k`` gave other outputs when recomputed (Note [recomputed state]): no plan
        recomputes it from now on."""
        self.shapes.never.add(k)
        self._replan = True

    def _scope_open(self) -> bool:
        return self.view.in_scope()

    # -- the step ----------------------------------------------------------------------------

    def forward_begins(self) -> None:
        """An outermost scope opens: finish what the last step taught, then reset."""
        if self.shapes.race is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # a raced step's time is the device's: from a quiet start
        self._step_t0 = self.clock()
        if self._replan:
            self._replan = False
            for sig in list(self.shapes.plans):
                self._adopt(sig, self.shapes.plan_for(sig))
        elif self.plan is not None:
            self._check(self.plan)
        race = self.shapes.race  # None if the check planned again
        if race is not None:
            race.end(self._step_t0)
            if race.done and (done := self.shapes.finish_race()) is not None:
                self._adopt(*done)
        self._armed = False
        self.settle(forward=True)
        if self.probe is not None:
            # the host cache's window is offloadd's own: every step is measured; CUDA's peak
            # statistics are the user's too: only the first step under a new plan
            self._armed = self._verify or self.probe.name == HostCacheProbe.name
            self._level0 = self.probe.restart() if self._armed else self.probe.level()
        self._step_peak = None
        self._step_no += 1
        self.plan = None
        self._first = True
        self._fwd_s = 0.0
        self.view.open_window()
        # Outside the blocks: kept (and before the model is known); without blocks: as usual.
        self.view.set_keep(self.root is None or bool(self.model.modules))
        self.view.set_tag(None)

    def forward_ends(self) -> None:
        if self._recording and self._profile is not None:
            self._recording = False
            self._profile.forward_ends()

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        k = self.model.index.get(id(module))
        if k is None or _in_backward() or not self._scope_open():
            return
        if not self._checkpointed_warned and recompute.checkpointed(args, kwargs):
            self._checkpointed_warned = True
            recompute.warn_checkpointed(self.root)
        if not torch.is_grad_enabled():
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
            if k == 0:
                self._mark_backward(args, kwargs)
        plan = self.plan
        self.view.set_keep(plan is not None and plan.decisions[k] != OFFLOAD)
        if self._recording:
            assert self._profile is not None
            self.view.set_tag(k)
            if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
                torch.cuda.synchronize()
            self._profile.block_begins(k, args, kwargs, module)
        self._fwd_start[k] = time.perf_counter()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        k = self.model.index.get(id(module))
        if k is None or _in_backward() or not self._scope_open() or not torch.is_grad_enabled():
            return
        last = k == len(self.model.modules) - 1
        self.view.set_keep(True)  # between blocks
        self.view.set_tag(None)
        if last:  # what runs after the blocks: the plan's last unit (see [the plan])
            plan = self.plan
            self.view.set_keep(plan is not None and plan.decisions[k + 1] != OFFLOAD)
            self.view.set_tag(k + 1 if self._recording else None)
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
            self.plan = self.last_plan = plan  # last_plan: the plan, not a race's contender
            race = self.shapes.start_race(sig)
            if race is not None and race.signature == sig:
                self.plan = race.begin(self._step_t0)
            elif race is not None:
                race.others += 1
                if race.others > PATIENCE:
                    self.shapes.give_way()
            return
        if self._profile is not None:
            return  # a profile waits for its backward; this forward offloads every block too
        if sig not in self._warm:  # the first forward of a shape warms caches and pools
            self._warm.add(sig)
            return
        self._profile = StepProfile(
            [*self.model.names, HEAD],
            sig,
            self.view.io_wait_s,
            probe=self.probe,
            base_level=self._level0,
            hooks=self._grad_hooks,
        )
        self._recording = True
        self.profiles += 1

    def _mark_backward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """When the step's gradient reaches the first block's input: a raced step's time ends
        there (see [race]), and so does a measured step's window (see [measured peaks]: what
        runs between steps, an evaluation, another model's step, is not the step's); this step's
        mark replaces the last one's on a leaf input ([one hook per tensor]). Not under
        torch.compile, whose graphs the hook would break: the window then ends at the next
        forward."""
        if torch.compiler.is_compiling():
            return
        x = first_grad_tensor([*args, *kwargs.values()])  # the tensor the profile times too
        if x is None:
            return
        race = self.shapes.race
        race = race if race is not None and race.running is not None else None
        peak = self._armed and self.probe is not None
        mark = None
        if race is not None or peak:
            mark = weakly(self._input_reached, self._step_no, race, peak)
        self._grad_hooks.mark(x, mark)

    def _input_reached(self, grad: torch.Tensor, step: int, race: Race | None, peak: bool) -> None:
        """Step ``step``'s gradient reached the first block's input (see ``_mark_backward``)."""
        if peak and self.probe is not None and step == self._step_no:
            self._step_peak = self.probe.peak()
        if race is not None:
            if grad.is_cuda:
                torch.cuda.synchronize()
            race.mark(self.clock())

    @property
    def plan_offloads(self) -> bool | None:
        """Whether the last plan offloads any block (None before the first plan; True while a
        race runs or waits: one of its contenders offloads every block)."""
        plan = self.last_plan
        if plan is None:
            return None
        return self.shapes.racing or OFFLOAD in plan.decisions

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

    def write_room(self) -> int | None:
        """The room of this step's plan; none in a profile step, so that its peaks hold the
        plan's own memory (None: warm-up, or a budget of CUDA's memory)."""
        if self.probe is not None and self.probe.name == CudaProbe.name:
            return None  # device memory: the sources held are host memory
        if self.plan is None:
            return 0 if self._profile is not None else None
        return self.plan.room

    # -- planning (plans.py) -------------------------------------------------------------------

    def _learn(self, prof: StepProfile) -> None:
        costs = prof.costs(kept=not self.offload)
        base, kept = self.view.window()
        self.shapes.measure = self.probe.name if self.probe is not None else None
        plan = self.shapes.learn(prof.signature, costs, base, kept)
        if plan is not None:  # else its next forward profiles it again (Note [refused once])
            self._adopt(prof.signature, plan)

    def _adopt(self, sig: tuple[Any, ...], plan: Plan) -> None:
        """A new plan for shape ``sig``: measure its next step; drift counts from there."""
        self.last_plan = plan
        self._verify = True
        self.drift.forget(sig)

    @property
    def plans(self) -> dict[tuple[Any, ...], Plan]:
        return self.shapes.plans

    @property
    def settled(self) -> bool:
        """A plan exists and neither a profile nor a race is pending."""
        return bool(self.plans) and self._profile is None and not self.shapes.racing

    def _check(self, plan: Plan) -> None:
        """After a planned step: memory over budget -> plan again; time drift -> profile."""
        sig = self._sig
        if sig is None or sig not in self.shapes.costs:
            return
        held: int | None = None
        if not self.shapes.costs[sig][0][0].measured:
            held = self.view.window()[0]
        elif self._armed and self.probe is not None:  # measured from its start
            self._verify = False
            peak = self._step_peak if self._step_peak is not None else self.probe.peak()
            held = peak - self._level0
        if held is not None and held > plan.budget:
            self._adopt(sig, self.shapes.over_budget(sig, held, plan))
            return
        on_cpu = not torch.cuda.is_available() or not torch.cuda.is_initialized()
        race = self.shapes.race
        if not on_cpu or self._fwd_s <= 0 or (race is not None and race.signature == sig):
            return  # a race alternates plans: their forward times differ
        ratio = self.drift.step(sig, self._fwd_s)
        if ratio is not None:
            log.info(
                "offloadd: budget: block forward times drifted (%.2fx the second planned "
                "step's); profiling again",
                ratio,
            )
            self.shapes.forget(sig)
