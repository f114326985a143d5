"""The optional stages of the pack path, as the runtime sees them: a budget planner and a codec.

The runtime owns these interfaces and implements neither: :mod:`offloadd.auto` implements
:class:`Planner` (keep, offload or recompute per block under ``Config.budget``) and
:mod:`offloadd.codec` implements :class:`Coder` (lossy codes of some saved activations, opt-in
with ``Config.codec``). They sit above the runtime and import it; the runtime never imports them.
The wiring is done once, at the edge: ``offloadd.Offloader`` (offloadd/offloader.py) passes
:class:`Stages` holding both factories to the :class:`~offloadd.runtime.runtime.Runtime` it
owns, which builds a stage only when its config asks for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from offloadd.config import Config
from offloadd.runtime.accounting import Ledger
from offloadd.runtime.identity import Facts
from offloadd.runtime.stats import Stats
from offloadd.runtime.thread_state import ThreadState

__all__ = [
    "HELD_ELSEWHERE",
    "HeldElsewhere",
    "Coder",
    "CoderFactory",
    "Planner",
    "PlannerFactory",
    "PlannerView",
    "Stages",
]


class HeldElsewhere:
    """Bytes a model holds outside offloadd's accounting and the allocator's counts, that a
    budget must leave room for (relay's slabs in host memory). The plug-in that holds them
    declares a bound method that counts them (:meth:`declare`); a planner asks through its view
    (:meth:`PlannerView.held_elsewhere`). Both sides are weak: the model, and the method's
    object (which the model holds), go when nothing else holds them."""

    def __init__(self) -> None:
        self._by_model: weakref.WeakKeyDictionary[nn.Module, weakref.WeakMethod[Any]] = (
            weakref.WeakKeyDictionary()
        )

    def declare(self, model: nn.Module, held: Callable[[], int]) -> None:
        """``held()`` (a bound method) counts what ``model`` holds elsewhere, from now on."""
        self._by_model[model] = weakref.WeakMethod(held)

    def forget(self, model: nn.Module) -> None:
        self._by_model.pop(model, None)

    def of(self, model: nn.Module | None) -> int:
        """What ``model`` holds elsewhere now (0 if nothing is declared)."""
        ref = self._by_model.get(model) if model is not None else None
        held = ref() if ref is not None else None
        return int(held()) if held is not None else 0


HELD_ELSEWHERE = HeldElsewhere()
"""The one registry: relay declares into it, the planner's view reads it."""


class PlannerView:
    """All a planner sees of the runtime and all it may set (see [auto] in auto/planner.py):
    the marks the hooks read for the block running on this thread, whether a scope is open on
    this thread, and the window of bytes held over a step. It holds no planner: what a user's
    tensor holds through it (a probe's callable) keeps no planner alive."""

    def __init__(self, ledger: Ledger, tls: ThreadState) -> None:
        self._ledger = ledger
        self._tls = tls

    def set_keep(self, keep: bool) -> None:
        """The block running on this thread keeps its saved tensors (its decision)."""
        self._tls.keep = keep

    def set_tag(self, tag: int | None) -> None:
        """The new storages saved on this thread count for block ``tag`` (None: for none)."""
        self._tls.tag = tag

    def in_scope(self) -> bool:
        """Whether one of the Offloader's scopes is open on this thread."""
        return bool(self._tls.stack)

    def open_window(self) -> None:
        """Start the step's window: its peaks start from what is held now."""
        ledger = self._ledger
        with ledger.lock:
            st = ledger.stats
            ledger.window_peak = st.resident_bytes + st.buffer_bytes
            ledger.kept_peak = ledger.kept_now

    def window(self) -> tuple[int, int]:
        """The most bytes held since :meth:`open_window` (resident and buffers), and of them
        the most kept as saved."""
        ledger = self._ledger
        with ledger.lock:
            return ledger.window_peak, ledger.kept_peak

    def buffer_bytes(self) -> int:
        """The bytes of offloadd's I/O buffers now."""
        return self._ledger.stats.buffer_bytes

    def io_wait_s(self) -> float:
        """The seconds backward has waited for reads so far."""
        return self._ledger.stats.io_wait_s

    def held_elsewhere(self, model: nn.Module | None) -> int:
        """What ``model`` holds outside offloadd's counts that a budget must leave room for
        (:class:`HeldElsewhere`: relay's slabs)."""
        return HELD_ELSEWHERE.of(model)


class Planner(Protocol):
    """Keep, offload or recompute per block (see [auto] in auto/planner.py), through the
    :class:`PlannerView` it is made with."""

    @property
    def root(self) -> nn.Module | None:
        """The model it plans (None until :meth:`attach`, and once that model is gone)."""

    last_plan: Any
    """The plan of the last step planned (None before the first)."""

    @property
    def plan_offloads(self) -> bool | None:
        """Whether the last plan offloads any block (None before the first plan)."""

    def attach(self, root: nn.Module) -> None:
        """Find ``root``'s blocks and hook them."""

    def detach(self) -> None:
        """Remove its hooks (the offloader closes)."""

    def plans_within(self, module: nn.Module) -> bool:
        """Whether what it plans lies within ``module``: the model it plans or one of its
        blocks, or, before it plans one, ``module`` itself (the first module noted)."""

    def forward_begins(self) -> None:
        """An outermost scope is entered: a forward begins (it may refuse the budget)."""

    def forward_ends(self) -> None:
        """The outermost scope is left: the forward ended."""

    def saved(self, tag: int, nbytes: int) -> None:
        """A new storage of ``nbytes`` was saved while block ``tag`` ran."""

    def settle(self) -> None:
        """Plan now if a profile step's backward has run."""

    def write_room(self) -> int | None:
        """The bytes the plan that runs leaves for sources held while they are written (0 in a
        profile step; see [room for writes] in writer_in_place.py); None: no such bound (the
        warm-up step, or a budget of device memory)."""


PlannerFactory = Callable[[Config, PlannerView], Planner]
"""``(config, view) -> Planner``, called when ``config.budget`` is set."""


class Coder(Protocol):
    """Lossy codes of saved activations, in the pack path (see [codes through the tiers] in
    codec/coder.py). What :meth:`pack` returns is of type :attr:`handle_type`; unpack hands
    exactly those back to :meth:`unpack`."""

    @property
    def handle_type(self) -> type:
        """The type of the handles :meth:`pack` returns."""

    def wants(self, t: torch.Tensor) -> bool:
        """Whether the op saving ``t`` allows it to be encoded."""

    def saved_exactly(self, t: torch.Tensor, facts: Facts) -> bool:
        """Whether ``t``'s storage is already saved exactly at its version. ``facts`` here and
        below: what pack asked of ``t`` (Note [asked once] in identity.py)."""

    def note_exact(self, t: torch.Tensor, facts: Facts | None = None) -> None:
        """``t`` was saved exactly."""

    def pack(
        self,
        t: torch.Tensor,
        facts: Facts,
        pack_codes: Callable[[torch.Tensor], Any],
        pack_exact: Callable[[torch.Tensor], Any],
    ) -> Any:
        """The coded handle of ``t``, or None to save it exactly."""

    def unpack(self, coded: Any, unpack_exact: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The decoded tensor of a handle :meth:`pack` returned."""

    def begin_step(self) -> None:
        """A step's first forward begins."""

    def scope(self) -> AbstractContextManager[Any]:
        """Entered with the hooks: notes which ops run while tensors are saved."""

    def note_stats(self, stats: Stats) -> None:
        """Copy its counters into ``stats``."""


CoderFactory = Callable[[Config], Coder]
"""``config -> Coder``, called when ``config.codec`` is not ``"none"``."""


@dataclass(frozen=True)
class Stages:
    """The factories of the optional stages (None: a config that asks for one is refused)."""

    planner: PlannerFactory | None = None
    coder: CoderFactory | None = None

    def check(self, cfg: Config) -> None:
        """Refuse a config that asks for a stage not provided, naming its key."""
        if cfg.budget is not None and self.planner is None:
            raise ValueError(
                f"offloadd: budget={cfg.budget!r} needs the budget planner, which this Offloader "
                "was not given: build offloadd.Offloader, or pass stages=Stages(planner=...)"
            )
        if cfg.codec.name != "none" and self.coder is None:
            raise ValueError(
                f"offloadd: codec.name={cfg.codec.name!r} needs the codec, which this Offloader was not "
                "given: build offloadd.Offloader, or pass stages=Stages(coder=...)"
            )
