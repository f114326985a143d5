"""The profile step: what each block saves and how long its forward, backward and I/O take.

A profile records the first forward of a step in which every block is offloaded, and the
backward of that forward. Per block it records:

- ``saved``: the bytes of the storages its forward saved that offloading moved (each storage
  once), counted by the offloader at pack;
- ``inputs``: the bytes of its tensor arguments (what recompute would keep instead);
- ``forward_s``: wall time from its forward pre-hook to its forward hook;
- ``backward_s``: the time between the gradient reaching its output and reaching its input,
  from tensor hooks on the inputs of every block and on the output of the last one (they
  observe, and change nothing);
- ``offload_s``: the training thread's I/O wait (``Stats.io_wait_s``) during its forward (a full
  staging pool) and during its backward (reads not prefetched in time); a wait under
  :data:`HIDDEN` of the unit's forward plus backward time counts as none (I/O hidden): a few
  hundred microseconds of timer and scheduling noise on one block and not the next would
  otherwise decide which blocks are kept, over the solver's tail-first tie-break (the blocks
  backward needs first, TBA's adaptive keep);

and for the step the peak of saved-activation bytes offloadd held (resident + its buffers). With
a :class:`~offloadd.auto.probe.MemoryProbe` (see [measured peaks] in probe.py) it also records,
per unit, the most memory in use during its forward and its backward and the level its backward
began at, all above the level when the step's forward began, and how far its forward raised
memory: the probe's window is restarted at every boundary (a block's forward begins or ends, the
gradient reaches a block's input or the last block's output), and each window's peak goes to the
unit that ran in it (the stretch between two blocks to the one before, what precedes the first
block to the first). On CUDA the forward times synchronize the device at the block boundaries of
the profile step only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadd.auto.grad_hooks import GradHooks
from offloadd.auto.probe import MemoryProbe
from offloadd.auto.solver import BlockCost

__all__ = ["HEAD", "HIDDEN", "StepProfile", "input_bytes", "module_state", "offload_cost"]

log = logging.getLogger("offloadd")

HEAD = "(after the blocks)"
"""The name of the last unit: what runs after the blocks (the head, the loss), up to the end of
the offload scope; its backward runs until the gradient reaches the last block's output."""


HIDDEN = 0.01
"""An I/O wait under this fraction of a unit's forward plus backward time counts as hidden."""


def offload_cost(wait: float, forward_s: float, backward_s: float) -> float:
    """A unit's ``offload_s`` from the I/O wait measured while it was offloaded (see the module
    docstring): the wait, or 0.0 where it is under :data:`HIDDEN` of the unit's own time."""
    wait = max(0.0, wait)
    return wait if wait >= HIDDEN * (forward_s + backward_s) else 0.0


def input_bytes(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> int:
    """Bytes of the distinct storages of the tensors among ``args`` and ``kwargs`` values."""
    seen: set[int] = set()
    total = 0
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor) and a.layout is torch.strided:
            st = a.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


_MODULE_KEYS = frozenset(vars(torch.nn.Module()))
_PLAIN = (int, float, complex, str, bytes, type(None))


def module_state(module: torch.nn.Module) -> dict[str, Any]:
    """What a forward could change besides buffers, per attribute of ``module``'s modules (by
    dotted name): the plain ones that are numbers or strings by value (a call counter, a
    schedule), the tensors that are neither parameters nor buffers by their version (Note
    [recomputed state] in recompute.py)."""
    out: dict[str, Any] = {}
    for prefix, m in module.named_modules():
        for key, v in vars(m).items():
            if key in _MODULE_KEYS or key.startswith("_offloadd"):
                continue
            if isinstance(v, torch.Tensor):  # changed in place (a new one assigned each call,
                # as weight_norm's or a kept attention map, is made from inputs: recomputes)
                out[f"{prefix}.{key}".lstrip(".")] = (v, 0 if v.is_inference() else v._version)
            elif isinstance(v, _PLAIN):
                out[f"{prefix}.{key}".lstrip(".")] = v
    return out


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The attributes whose :func:`module_state` differs between ``before`` and ``after``."""
    gone = object()
    return sorted(
        a
        for a in before.keys() | after.keys()
        if not _equal(before.get(a, gone), after.get(a, gone))
    )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and a and isinstance(a[0], torch.Tensor):  # a tensor's entry
        if not isinstance(b, tuple) or b[0] is not a[0]:
            return True  # another tensor assigned: made by the forward from what it was given
        return bool(a[1] == b[1])
    return a is b or bool(a == b)


def _versions(
    args: tuple[Any, ...], kwargs: dict[str, Any] | None, module: torch.nn.Module
) -> tuple[Any, ...]:
    """The version counters of the tensor arguments and of the module's buffers, and its
    :func:`module_state`."""
    inputs = tuple(
        a._version for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)
    )
    return inputs, tuple(b._version for b in module.buffers()), module_state(module)


def first_grad_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value`` (a tensor, or a tuple/list of them) that requires grad."""
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, tuple | list):
        for v in value:
            t = first_grad_tensor(v)
            if t is not None:
                return t
    return None


@dataclass
class StepProfile:
    """One profile step in the making (see the module docstring)."""

    names: list[str]
    signature: tuple[Any, ...]
    wait: Callable[[], float]
    """The offloader's I/O wait so far (``Stats.io_wait_s``)."""
    probe: MemoryProbe | None = None
    base_level: int = 0
    """The probe's level when the step's forward began."""
    hooks: GradHooks = field(default_factory=GradHooks)
    """Where its gradient hooks go: the planner's (see [one hook per tensor] in grad_hooks.py)."""
    started: float = field(default_factory=time.perf_counter)
    saved: list[int] = field(init=False)
    inputs: list[int] = field(init=False)
    fwd: list[float] = field(init=False)
    fwd_wait: list[float] = field(init=False)
    grad_in: list[tuple[float, float] | None] = field(init=False)  # (time, io wait) at input
    grad_out_last: tuple[float, float] | None = None
    forward_end: float = 0.0
    forward_end_wait: float = 0.0
    later_forwards: int = 0  # forwards begun since this one ended
    pending_hooks: int = 0
    _open: dict[int, tuple[float, float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        n = len(self.names)  # the blocks, then HEAD
        self.saved = [0] * n
        self.inputs = [0] * n
        self.fwd = [0.0] * n
        self.fwd_wait = [0.0] * n
        self.grad_in = [None] * n
        self.mutates = [False] * n
        self._versions: dict[int, Any] = {}
        # measured (with a probe), above base_level: see the module docstring
        self.peak_fwd = [0] * n
        self.rise_fwd = [0] * n
        self.peak_bwd = [0] * n
        self.level_bwd = [0] * n
        self._unit = 0  # the unit the probe's window is charged to
        self._start = 0  # the level the window began at
        self._backward = False
        if self.probe is not None:
            self._start = self.probe.restart() - self.base_level

    # -- memory ----------------------------------------------------------------------------

    def _window(self, next_unit: int, *, backward: bool = False) -> None:
        """Close the probe's window (its peak to the unit it was charged to) and open the next."""
        probe = self.probe
        if probe is None:
            return
        peak = probe.peak() - self.base_level
        k = self._unit
        if k < 0:  # past the first block's backward: not a unit's
            pass
        elif self._backward:
            self.peak_bwd[k] = max(self.peak_bwd[k], peak)
        else:
            self.peak_fwd[k] = max(self.peak_fwd[k], peak)
            self.rise_fwd[k] = max(self.rise_fwd[k], peak - self._start)
        self._start = probe.restart() - self.base_level
        self._unit, self._backward = next_unit, backward
        if backward and next_unit >= 0:
            self.level_bwd[next_unit] = self._start

    # -- forward ---------------------------------------------------------------------------

    def block_begins(
        self, k: int, args: tuple[Any, ...], kwargs: dict[str, Any], module: torch.nn.Module
    ) -> None:
        self._versions[k] = (args, kwargs, _versions(args, kwargs, module))
        if k > 0 or self._unit != 0:
            self._window(k)  # what ran since the last boundary: the block before (or block 0)
        wait = self.wait()
        self.inputs[k] = input_bytes(args, kwargs)
        x = first_grad_tensor(list(args) + list(kwargs.values()))
        if x is not None:
            self._hook(x, lambda t, w: self._set_in(k, t, w))
        self._open[k] = (time.perf_counter(), wait)

    def block_ends(self, k: int, output: Any, last: bool, module: torch.nn.Module) -> None:
        seen = self._versions.pop(k, None)
        if seen is not None:
            after = _versions(seen[0], seen[1], module)
            changed = _changed(seen[2][2], after[2])
            if seen[2][:2] != after[:2] or changed:
                self.mutates[k] = True
            if changed:
                log.info(
                    "offloadd: budget: block %s changes %s in its forward: it is never "
                    "recomputed (Note [recomputed state] in offloadd/auto/recompute.py)",
                    self.names[k],
                    ", ".join(changed),
                )
        wait = self.wait()
        start = self._open.pop(k, None)
        if start is None:
            return
        now = time.perf_counter()
        self.fwd[k] += now - start[0]
        self.fwd_wait[k] += wait - start[1]
        self._window(len(self.names) - 1 if last else k)  # HEAD begins, or a gap: still k's
        if last:
            y = first_grad_tensor(output)
            if y is not None:
                self._hook(y, self._set_out_last)
            self._open[len(self.names) - 1] = (now, wait)  # HEAD begins

    def forward_ends(self) -> None:
        """The offload scope closes: HEAD's forward is over."""
        self.forward_end, self.forward_end_wait = time.perf_counter(), self.wait()
        head = len(self.names) - 1
        self._window(head, backward=True)  # from here to the last block's output: HEAD's backward
        start = self._open.pop(head, None)
        if start is not None:
            self.fwd[head] += self.forward_end - start[0]
            self.fwd_wait[head] += self.forward_end_wait - start[1]

    def _hook(self, t: torch.Tensor, record: Any) -> None:
        with self._lock:
            self.pending_hooks += 1

        def on_grad(g: torch.Tensor) -> None:
            record(time.perf_counter(), self.wait())
            with self._lock:
                self.pending_hooks -= 1

        self.hooks.once(t, on_grad)

    def _set_in(self, k: int, t: float, w: float) -> None:
        if self.grad_in[k] is None:
            self.grad_in[k] = (t, w)
            if self._backward and self._unit == k:
                self._window(k - 1, backward=True)  # -1: the embeddings' backward, no unit's

    def _set_out_last(self, t: float, w: float) -> None:
        if self.grad_out_last is None:
            self.grad_out_last = (t, w)
            if self._backward and self._unit == len(self.names) - 1:
                self._window(len(self.names) - 2, backward=True)

    # -- the result ------------------------------------------------------------------------

    def complete(self) -> bool:
        """Whether the backward of the profiled forward has run (every hook fired)."""
        with self._lock:
            return self.forward_end > 0 and self.pending_hooks <= 0  # retain_graph: 2 passes

    def costs(self, *, kept: bool = False) -> list[BlockCost]:
        """Per block, in list order (a block that did not run costs nothing and saves nothing).
        ``kept``: every block was kept in the profile (tier keep), not offloaded: the measured
        peaks lose what the units before each one held, to stand as [the plan] reads them."""
        n = len(self.names) - 1  # blocks; unit n is HEAD
        out = []
        prefix = 0
        for k in range(n):
            start = self.grad_out_last if k == n - 1 else self.grad_in[k + 1]
            end = self.grad_in[k]
            if start is not None and end is not None and end[0] >= start[0]:
                bwd, bwd_wait = end[0] - start[0], max(0.0, end[1] - start[1])
            else:  # the gradient did not reach this block's input: the usual 2x of forward
                bwd, bwd_wait = 2 * self.fwd[k], 0.0
            out.append(
                BlockCost(
                    name=self.names[k],
                    saved=self.saved[k],
                    inputs=self.inputs[k],
                    forward_s=self.fwd[k],
                    backward_s=bwd,
                    offload_s=offload_cost(self.fwd_wait[k] + bwd_wait, self.fwd[k], bwd),
                    # Recomputing a block that changes its inputs or buffers in place (BatchNorm's
                    # running statistics, relu_ on its input) would change them twice, or break
                    # backward: such blocks are kept or offloaded.
                    recomputable=not self.mutates[k],
                    **self._measured(k, prefix if kept else 0, self.saved[k] if kept else 0),
                )
            )
            prefix += self.saved[k]
        g = self.grad_out_last
        bwd, bwd_wait = (
            (g[0] - self.forward_end, max(0.0, g[1] - self.forward_end_wait))
            if g is not None and self.forward_end
            else (2 * self.fwd[n], 0.0)
        )
        out.append(
            BlockCost(
                name=HEAD,
                saved=self.saved[n],
                inputs=0,
                forward_s=self.fwd[n],
                backward_s=bwd,
                offload_s=offload_cost(self.fwd_wait[n] + bwd_wait, self.fwd[n], bwd),
                recomputable=False,
                **self._measured(n, prefix if kept else 0, self.saved[n] if kept else 0),
            )
        )
        return out

    def _measured(self, k: int, before: int, own: int) -> dict[str, int]:
        """Unit ``k``'s measured peaks as [the plan] reads them: less ``before``, what the units
        before it held in the profile, and, where its own saved bytes were held as well (in
        forward, and when its backward began), less ``own``."""
        if self.probe is None:
            return {}
        return {
            "peak_fwd": max(0, self.peak_fwd[k] - before - own),
            "peak_bwd": max(0, self.peak_bwd[k] - before),
            "level_bwd": max(0, self.level_bwd[k] - before - own),
            "rise_fwd": self.rise_fwd[k],
        }
