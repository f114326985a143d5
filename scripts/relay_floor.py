"""The least a Python relay of this design costs: a minimal relay beside relay itself.

The minimal relay has what relay's swap cannot do without and nothing more. It has each layer's
module hooks, a saved-tensor pair that turns saved views of the weights into tuples, and slabs
from relay's pool with their views made once. It copies each group from a host record, reads
one group ahead in forward, and reads each group again at its first unpack in backward. It has
no write checks, no placeholders, no ref bookkeeping, no carrying into backward, no reads on
demand, no profiler ranges, and no errors. Its gradients are checked bit for bit against the
plain model. On ``bench hooks``' micro model at width 128, it runs interleaved with the plain
model, relay's hooks alone (the ``floor`` arm of ``bench hooks --relay``) and relay itself from
the host store. Each figure is µs a group swap above plain (128 swaps a step)."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
from torch import nn

from offloadd.io.buffers import copy_bytes
from offloadd.relay.slabs import Slabs
from offloadd.runtime.compiled import unseen
from offloadd.tools.bench.hooks import micro_model
from offloadd.tools.bench.hooks_arms import _hooked_like_relay, _relay_from_host

_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks
Layout = tuple[tuple[torch.dtype, int, tuple[int, ...], tuple[int, ...]], ...]


class _Group:
    def __init__(self, index: int, linear: nn.Linear) -> None:
        w, b = linear.weight, linear.bias
        assert b is not None
        at = -(-w.nbytes // 64) * 64  # the bias 64-byte aligned, as relay lays it out
        self.record = torch.zeros(at + b.nbytes, dtype=torch.uint8)
        self.record[: w.nbytes].copy_(w.detach().flatten().view(torch.uint8))
        self.record[at:].copy_(b.detach().view(torch.uint8))
        self.index, self.params = index, [w, b]
        self.layout: Layout = (
            (w.dtype, 0, tuple(w.shape), tuple(w.stride())),
            (b.dtype, at // b.element_size(), tuple(b.shape), (1,)),
        )
        self.empty = torch.empty(0)
        self.slab: torch.Tensor | None = None

    def views_of(self, slab: torch.Tensor) -> list[torch.Tensor]:
        st = slab.untyped_storage()
        return [torch.empty(0, dtype=d).set_(st, o, s, strides) for d, o, s, strides in self.layout]


class MinimalRelay:
    """See the module's docstring. Call :meth:`end_step` after each backward."""

    def __init__(self, model: nn.Module) -> None:
        self.slabs = Slabs(keep=1)
        self.groups: list[_Group] = []
        for layer in model.layers:  # type: ignore[union-attr]
            linear = next(m for m in layer.modules() if isinstance(m, nn.Linear))
            g = _Group(len(self.groups), linear)
            self.groups.append(g)
            layer.register_forward_pre_hook(unseen(lambda m, a, g=g: self.pre(g)))
            layer.register_forward_hook(unseen(lambda m, a, o, g=g: self.post(g)), always_call=True)
        self.ahead: dict[int, torch.Tensor] = {}
        self.backward: dict[int, torch.Tensor] = {}
        self.slab_group: dict[int, _Group] = {}
        self.hooks = (unseen(self.pack), unseen(self.unpack))

    def read(self, g: _Group) -> torch.Tensor:
        slab, to = self.slabs.take_to(g.record.numel())
        copy_bytes(to, g.record.data_ptr(), g.record.numel())
        return slab

    def pre(self, g: _Group) -> None:
        slab = self.ahead.pop(g.index, None)
        if slab is None:
            slab = self.read(g)
        views = self.slabs.views(slab, g.layout, g.views_of)
        assert views is not None
        for p, v in zip(g.params, views, strict=True):
            p.data = v
        g.slab = slab
        self.slab_group[slab.untyped_storage()._cdata] = g
        if g.index + 1 < len(self.groups):
            self.ahead[g.index + 1] = self.read(self.groups[g.index + 1])
        _push(*self.hooks)

    def post(self, g: _Group) -> None:
        _pop()
        for p in g.params:
            p.data = g.empty
        assert g.slab is not None
        del self.slab_group[g.slab.untyped_storage()._cdata]
        g.slab = None

    def pack(self, t: torch.Tensor) -> Any:
        g = self.slab_group.get(t.untyped_storage()._cdata)
        if g is None:  # detached where it has a grad_fn, as relay keeps it
            return t if t.is_leaf else t.detach()
        return (g.index, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def unpack(self, x: Any) -> torch.Tensor:
        if type(x) is not tuple:
            return x  # type: ignore[no-any-return]
        i, dtype, offset, size, stride = x
        slab = self.backward.get(i)
        if slab is None:
            slab = self.backward[i] = self.read(self.groups[i])
            self.backward.pop(i + 1, None)
        return torch.empty(0, dtype=dtype).set_(slab.untyped_storage(), offset, size, stride)

    def end_step(self) -> None:
        self.backward.clear()


def options(doc: str) -> argparse.ArgumentParser:
    """The micro model's options, and the rounds' (saved_hooks_floor.py takes them too)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", help="write the figures here")
    return p


def frozen_micro(ns: argparse.Namespace) -> nn.Module:
    """``bench hooks``' micro model with its Linear layers frozen (relay's groups), one thread."""
    torch.set_num_threads(1)
    plain = micro_model(ns.blocks, ns.width)
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            m.requires_grad_(False)
    return plain


def medians(arms: dict[str, Any], step: Any, rounds: int, steps: int) -> dict[str, float]:
    """Each arm's median step time over ``rounds`` rounds of ``steps`` steps, the arms in turn
    (reversed every other round), after three rounds of warm-up."""
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(-3, rounds):
        for name in arms if r % 2 == 0 else reversed(list(arms)):
            t0 = time.perf_counter()
            for _ in range(steps):
                step(arms[name])
            if r >= 0:
                times[name].append((time.perf_counter() - t0) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def written(ns: argparse.Namespace, out: dict[str, Any]) -> int:
    """Write ``out`` to ``--json``, if given; the exit status."""
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = options(__doc__).parse_args(argv)
    plain = frozen_micro(ns)
    minimal_model = copy.deepcopy(plain)
    minimal = MinimalRelay(minimal_model)
    x = torch.randn(ns.batch, ns.width, requires_grad=True)
    want = torch.autograd.grad(plain(x).square().mean(), x)[0]
    got = torch.autograd.grad(minimal_model(x).square().mean(), x)[0]
    minimal.end_step()
    if not torch.equal(want, got):
        raise SystemExit("the minimal relay's gradients differ from the plain model's")
    arms = {
        "plain": plain,
        "hooks": _hooked_like_relay(copy.deepcopy(plain)),
        "minimal": minimal_model,
        "relay": _relay_from_host(copy.deepcopy(plain)),
    }

    def step(model: nn.Module) -> None:
        model(x).square().mean().backward()
        minimal.end_step()

    for model in arms.values():
        step(model)  # warm-up, and the order relay learns
    med = medians(arms, step, ns.rounds, ns.steps)
    swaps = 2 * ns.blocks
    out = {
        "plain_ms": med["plain"] * 1e3,
        **{f"{k}_us_per_swap": (med[k] - med["plain"]) / swaps * 1e6 for k in arms if k != "plain"},
    }
    print(
        f"plain {out['plain_ms']:.3f} ms a step; µs a group swap above plain: "
        + ", ".join(f"{k} {out[f'{k}_us_per_swap']:.1f}" for k in arms if k != "plain")
    )
    return written(ns, out)


if __name__ == "__main__":
    raise SystemExit(main())
