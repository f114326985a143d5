"""The arms of ``offloadd bench hooks`` (see hooks.py), and relay's cost per group swapped."""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offloadd.offloader import Offloader

__all__ = ["ARMS", "Arm", "open_arms", "relay_cost", "tier_kwargs"]

ARMS = (
    "none",
    "noop",
    "safe",
    "keep-all",
    "keep",
    "ssd",
    "ssd-all",
    "daemon-all",
    "auto",
    "cpu",
    "cpu-all",
)


def _same(t: Any) -> Any:
    return t


@dataclass
class Arm:
    name: str
    scope: Callable[[], AbstractContextManager[Any]]
    skipped: str = ""


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_leaf else t.detach()


def _noop() -> AbstractContextManager[Any]:
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _safe() -> AbstractContextManager[Any]:
    """The least a hook that holds saved tensors must do: detach what has a ``grad_fn`` (an op's
    output saved by that op and returned as it is would hold its own graph: a cycle through C++,
    never collected when the graph is dropped without a backward); a leaf makes none."""
    return torch.autograd.graph.saved_tensors_hooks(_detached, _same)


def _same_each_time(off: Offloader) -> Callable[[], AbstractContextManager[Any]]:
    def scope() -> AbstractContextManager[Any]:
        return off

    return scope


@contextlib.contextmanager
def _daemon(workdir: Path) -> Iterator[str]:
    """An ``offloadd serve`` subprocess for the run; stopped (SIGTERM) at the end."""
    run = workdir / "daemon"
    data = run / "data"
    data.mkdir(parents=True, exist_ok=True)
    sock = str(run / "d.sock")
    log = open(run / "daemon.log", "wb")  # noqa: SIM115 (closed below)
    cmd = [sys.executable, "-m", "offloadd", "serve", "--socket", sock, "--dir", str(data)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not Path(sock).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"offloadd serve did not start: see {run / 'daemon.log'}")
            time.sleep(0.05)
        yield sock
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def tier_kwargs(name: str, workdir: Path) -> dict[str, Any]:
    """The Offloader options of a tier's arm: ``keep``, ``ssd``, ``cpu`` with their defaults,
    ``-all`` with ``min_bytes=0`` (every tensor through offloadd); ssd's files in ``workdir``."""
    tier = name.removesuffix("-all")
    kwargs: dict[str, Any] = {"tier": tier}
    if tier == "ssd":
        kwargs["ssd_dirs"] = [str(workdir)]
    if name.endswith("-all"):
        kwargs["min_bytes"] = 0
    return kwargs


@contextlib.contextmanager
def open_arms(names: list[str], workdir: Path, budget: str, device: str) -> Iterator[list[Arm]]:
    """The arms asked for, their Offloaders open (all before any is timed: the host allocator
    one may install is then under every arm alike); closed at the end."""
    ssd = {"ssd_dirs": [str(workdir)]}
    with contextlib.ExitStack() as stack:
        arms: list[Arm] = []
        for name in names:
            kwargs: dict[str, Any] | None = None
            if name == "none":
                arms.append(Arm(name, nullcontext))
            elif name == "noop":
                arms.append(Arm(name, _noop))
            elif name == "safe":
                arms.append(Arm(name, _safe))
            elif name.startswith("cpu") and device != "cuda":
                arms.append(Arm(name, nullcontext, "tier cpu moves CUDA tensors: no GPU here"))
            elif name == "daemon-all":
                sock = stack.enter_context(_daemon(workdir))
                kwargs = {"tier": "ssd", "min_bytes": 0, "daemon": {"socket": sock}}
            elif name == "auto":
                kwargs = {"tier": "ssd", "min_bytes": 0, "budget": budget, **ssd}
            else:
                kwargs = tier_kwargs(name, workdir)
            if kwargs is not None:
                off = Offloader(**kwargs)
                stack.callback(off.close)
                arms.append(Arm(name, _same_each_time(off)))
        yield [a for a in arms if not a.skipped] + [a for a in arms if a.skipped]


def relay_cost(
    ns: argparse.Namespace, workdir: Path, build: Callable[[int, int], nn.Module]
) -> dict[str, Any]:
    """Relay's cost per group swap: the micro model at width 128 (a Linear's weight is 64 KiB,
    one group), every Linear frozen and relayed (window 2) from two stores, against a deep copy
    of it without relay, the three steps interleaved:

    - ``host``: relayed from the store that keeps each group in host memory (the cpu tier's
      :class:`~offloadd.relay.store.HostStore`, which copies a group into a slab for a CPU
      model: no I/O, no I/O thread): relay's own host work;
    - ``ssd``: tier ssd, its reads O_DIRECT (no page cache) into slabs: that work, the I/O
      thread's round trip, and the disk's latency that the window does not hide;
    - ``floor``: the model with relay's hooks and no relay (each layer's pre-hook pushes a
      saved-tensor pair that returns what it is given, its post-hook pops it): what any relay
      built on module hooks and Python saved-tensor hooks pays before it moves a byte.

    A swap is a group brought in for use (``relay_stats().swaps``: swapped in for its forward,
    or brought back for its backward), however it came (read, read ahead, carried from forward),
    so a path that skips a read leaves the count as it is."""
    from offloadd.relay import relay, relay_stats

    width = max(ns.width, 128)
    plain = build(ns.blocks, width)
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            m.requires_grad_(False)
    relayed = {
        "host": _relay_from_host(copy.deepcopy(plain)),
        "ssd": relay(copy.deepcopy(plain), window=2, tier="ssd", ssd_dirs=[str(workdir)]),
    }
    x = torch.randn(ns.batch, width, requires_grad=True)

    def step_of(model: nn.Module) -> Callable[[], None]:
        def step() -> None:
            model(x).square().mean().backward()

        return step

    floor = _hooked_like_relay(copy.deepcopy(plain))
    steps = {
        "plain": step_of(plain),
        "floor": step_of(floor),
        **{k: step_of(m) for k, m in relayed.items()},
    }
    for step in steps.values():
        step()  # warm-up, and the order of the groups the first forward learns
    before = {k: relay_stats(m) for k, m in relayed.items()}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(-3, ns.rounds):  # three rounds of warm-up
        for name in steps if r % 2 == 0 else reversed(list(steps)):
            t0 = time.perf_counter()
            for _ in range(ns.steps):
                steps[name]()
            if r >= 0:
                times[name].append((time.perf_counter() - t0) / ns.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_steps = (ns.rounds + 3) * ns.steps
    out: dict[str, Any] = {"plain_ms": med["plain"] * 1e3, "floor_ms": med["floor"] * 1e3}
    for name, model in relayed.items():
        st, was = relay_stats(model), before[name]
        swaps = (st.swaps - was.swaps) / n_steps
        group_bytes = st.written_bytes / max(st.groups, 1)  # a record, as written and read
        out["groups"] = st.groups
        out[name] = {
            "swaps_per_step": round(swaps, 1),
            "reads_per_step": round((st.read_bytes - was.read_bytes) / group_bytes / n_steps, 1),
            "relay_ms": med[name] * 1e3,
            "x_plain": med[name] / med["plain"],
            "us_per_swap": (med[name] - med["plain"]) / max(swaps, 1) * 1e6,
            # the rounds' spread: this arm's fastest round against plain's slowest, and back
            "us_per_swap_range": (
                (min(times[name]) - max(times["plain"])) / max(swaps, 1) * 1e6,
                (max(times[name]) - min(times["plain"])) / max(swaps, 1) * 1e6,
            ),
            "floor_us_per_swap": (med["floor"] - med["plain"]) / max(swaps, 1) * 1e6,
            "wait_s_per_step": (st.wait_s - was.wait_s) / n_steps,
        }
    return out


def _hooked_like_relay(model: nn.Module) -> nn.Module:
    """``model`` (the micro model) with the hooks relay gives each layer and nothing behind
    them: a pre-hook that pushes a pass-through saved-tensor pair (detaching what has a
    ``grad_fn``, as relay's does), a post-hook that pops it (run even if forward raised), each
    run with dynamo's frame callback off as relay's are."""
    from offloadd.runtime.compiled import unseen

    push = torch._C._autograd._push_saved_tensors_default_hooks
    pop = torch._C._autograd._pop_saved_tensors_default_hooks
    pack = unseen(_detached)  # what relay's pair keeps of what it passes on
    unpack = unseen(_same)

    def pre(module: nn.Module, args: Any) -> None:
        push(pack, unpack)

    def post(module: nn.Module, args: Any, out: Any) -> None:
        pop()

    for layer in model.layers:  # type: ignore[union-attr]
        layer.register_forward_pre_hook(unseen(pre))
        layer.register_forward_hook(unseen(post), always_call=True)
    return model


def _relay_from_host(model: nn.Module) -> nn.Module:
    """``model`` relayed (window 2) from a :class:`~offloadd.relay.store.HostStore`, which the cpu
    tier takes only where CUDA is (a CPU model's weights are in host memory already)."""
    from offloadd.relay import relay, surface
    from offloadd.relay.store import HostStore

    opened = surface.open_store
    surface.open_store = lambda cfg, device, largest=0: HostStore()
    try:
        return relay(model, window=2, tier="ssd")
    finally:
        surface.open_store = opened
