"""Every storage a traced run makes and frees, in order, on fake tensors (no memory is used).

:class:`LiveBytes` is a dispatch mode: each op's outputs' storages are noted when first seen,
with their size and the phase the trace is in, and a finalizer notes when one is freed. That
is what torch's allocator would be asked for, op by op; temporaries a kernel allocates inside
itself (below the dispatcher) are not seen, nor are sparse outputs, nor a storage's resize after
it was first seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Event", "LiveBytes"]


@dataclass(frozen=True, slots=True)
class Event:
    """A storage made (``nbytes`` > 0) or freed (``nbytes`` < 0); ``key`` names it while it
    lives, ``phase`` is the trace's at that moment."""

    key: int
    nbytes: int
    phase: str


@dataclass(slots=True)
class _State:
    live: dict[int, tuple[int, str]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    now: int = 0
    peak: int = 0


class LiveBytes(TorchDispatchMode):
    """Records :attr:`events`; :attr:`peak` is the most bytes live at once. ``stand_ins`` run
    in an op's place (what they make inside is not counted, only their outputs)."""

    def __init__(self, stand_ins: dict[Any, Callable[..., Any]] | None = None) -> None:
        super().__init__()
        self._s = _State()
        self.phase = "build"
        self.stand_ins = stand_ins or {}

    @property
    def events(self) -> list[Event]:
        return self._s.events

    @property
    def peak(self) -> int:
        return self._s.peak

    @property
    def now(self) -> int:
        return self._s.now

    def live_by_phase(self) -> dict[str, int]:
        """The bytes live now, by the phase that made them."""
        out: dict[str, int] = {}
        for nbytes, phase in self._s.live.values():
            out[phase] = out.get(phase, 0) + nbytes
        return out

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        out = self.stand_ins.get(func, func)(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                self.note(t)
        return out

    def note(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage from now until it is freed (once, however often seen)."""
        st = t.untyped_storage()
        key, nbytes, s = st._cdata, st.nbytes(), self._s
        if not nbytes or key in s.live:
            return
        s.live[key] = (nbytes, self.phase)
        s.events.append(Event(key, nbytes, self.phase))
        s.now += nbytes
        s.peak = max(s.peak, s.now)
        weakref.finalize(st, _freed, s, key)


def _freed(s: _State, key: int) -> None:
    nbytes, _ = s.live.pop(key)
    s.now -= nbytes
    s.events.append(Event(key, -nbytes, "free"))
