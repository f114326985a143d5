"""Relay's host work per group, taken apart: what each part of a swap costs, and its floors.

``offloadd bench hooks --relay`` gives relay's whole cost per group swapped on its micro model
(64 blocks of ``Linear(128, 128) · GELU · LayerNorm``, every Linear frozen and relayed from the
host store: no I/O) and the floor of relay's hooks. This script takes the forward's swap apart
on the same model, under ``torch.no_grad()`` (forward only: one swap a group), in one process:

- the forward with the write guard and without it (two relayed copies, interleaved with the
  plain model; median over ``--rounds``), per group above plain;
- each part of the swap, timed inside the guarded copy by wrapping its method (a wrapper costs
  ~0.2 us, included): the pre-hook (``on_group_forward``) with its ``install`` and its reads
  (``read``: a slab taken and the group copied in; ``_prefetch_forward``: the read ahead), the
  post-hook (``after_group_forward``) with its ``uninstall``, the guard's two calls
  (``Slabs.guard``, ``Slabs.unguard``: an ``mprotect`` each), and the host store's copy
  (``memmove``) alone;
- the floors, timed apart: an ``mprotect`` pair over a group's populated pages, and a memmove
  of a group's bytes.

    python scripts/relay_parts.py --rounds 21
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import mmap
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from offloadd.relay import store as store_mod
from offloadd.relay.relayer import Relay
from offloadd.relay.slabs import Slabs
from offloadd.relay.state import state_of
from offloadd.tools.bench.hooks import micro_model
from offloadd.tools.bench.hooks_arms import _relay_from_host

PARTS = (
    (Relay, "on_group_forward"),
    (Relay, "install"),
    (Relay, "read"),
    (Relay, "_prefetch_forward"),
    (Relay, "after_group_forward"),
    (Relay, "uninstall"),
    (Slabs, "guard"),
    (Slabs, "unguard"),
)


def _timed(spent: dict[str, float], name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    return call


def _floors(group_bytes: int, groups: int, n: int = 20000) -> dict[str, float]:
    """An mprotect pair over a group's populated pages, and a memmove of its bytes from each of
    ``groups`` records in turn, as the host store copies them (out of cache: us)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = -(-group_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    mm = mmap.mmap(-1, (groups + 1) * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    first = ctypes.c_char.from_buffer(mm)
    a = ctypes.addressof(first)
    ctypes.memset(a, 1, (groups + 1) * size)
    t0 = time.perf_counter()
    for _ in range(n):
        if libc.mprotect(a, size, mmap.PROT_READ) or libc.mprotect(
            a, size, mmap.PROT_READ | mmap.PROT_WRITE
        ):
            raise OSError(ctypes.get_errno(), "mprotect failed")
    pair = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for i in range(n):
        ctypes.memmove(a, a + (1 + i % groups) * size, group_bytes)
    move = (time.perf_counter() - t0) / n
    del first
    mm.close()
    return {"mprotect_pair_us": pair * 1e6, "memmove_us": move * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=21, help="interleaved rounds (default 21)")
    p.add_argument("--steps", type=int, default=20, help="forwards per arm and round")
    p.add_argument("--json", default=None, help="write the results here")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = micro_model(ns.blocks, ns.width)
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            m.requires_grad_(False)
    guarded = _relay_from_host(copy.deepcopy(plain))
    unguarded = _relay_from_host(copy.deepcopy(plain))
    state_of(unguarded).relay.slabs.guarding = False
    arms = {"plain": plain, "guarded": guarded, "unguarded": unguarded}
    x = torch.randn(ns.batch, ns.width)

    def forward(m: nn.Module) -> None:
        with torch.no_grad():
            m(x)

    for m in arms.values():
        for _ in range(5):
            forward(m)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(ns.rounds):
        for name in arms if r % 2 == 0 else reversed(list(arms)):
            t0 = time.perf_counter()
            for _ in range(ns.steps):
                forward(arms[name])
            times[name].append((time.perf_counter() - t0) / ns.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    per_group = {k: (med[k] - med["plain"]) / ns.blocks * 1e6 for k in ("guarded", "unguarded")}

    spent: dict[str, float] = {}
    originals = [(cls, name, getattr(cls, name)) for cls, name in PARTS]
    real_memmove = ctypes.memmove

    class _Ctypes:  # the host store's ctypes, its memmove timed
        @staticmethod
        def memmove(dst: int, src: int, n: int) -> Any:
            return _timed(spent, "memmove", real_memmove)(dst, src, n)

    for cls, name, f in originals:
        setattr(cls, name, _timed(spent, name, f))
    store_mod.ctypes = _Ctypes  # type: ignore[assignment]
    try:
        n = 10 * ns.steps
        for _ in range(n):
            forward(guarded)
    finally:
        for cls, name, f in originals:
            setattr(cls, name, f)
        store_mod.ctypes = ctypes
    parts = {k: v / (n * ns.blocks) * 1e6 for k, v in spent.items()}
    group_bytes = 4 * (ns.width * ns.width + ns.width)
    doc = {
        "per_group_above_plain_us": per_group,
        "parts_us_per_group": parts,
        "floors": _floors(group_bytes, ns.blocks),
        "group_bytes": group_bytes,
        "plain_forward_ms": med["plain"] * 1e3,
    }
    print(f"forward, no grad, {ns.blocks} groups of {group_bytes} bytes, plain "
          f"{med['plain'] * 1e3:.3f} ms")  # fmt: skip
    for k, v in per_group.items():
        print(f"  relayed, {k}: {v:.1f} us a group above plain")
    print("  parts (inside the guarded copy, us a group):")
    for k, v in parts.items():
        print(f"    {k:<22}{v:8.2f}")
    for k, v in doc["floors"].items():
        print(f"  floor {k}: {v:.2f}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
