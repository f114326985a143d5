"""What a saved-tensor hook pair costs autograd itself, whatever language the hooks are in.

On ``bench hooks``' micro model (width 128, its Linear layers frozen, as ``relay_floor.py``
runs it), each layer's forward pushes a pair and pops it, through module hooks as relay's are.
Arms, interleaved in one process: plain; the module hooks alone (nothing pushed); a Python
identity pair, run with dynamo's frame callback off as relay's are (``unseen``); the same pair
without that; and a pair of C methods (``Tensor.to``, which with nothing to convert to gives the
tensor back as it is: no Python frame). Each figure is µs a
layer (a group of relay) and step above plain, and the last column µs a hooked saved tensor.

    python scripts/saved_hooks_floor.py [--rounds 15] [--json OUT]

It imports ``relay_floor.py`` beside it, so it runs as a file only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from relay_floor import frozen_micro, medians, options, written  # type: ignore[import-not-found]
from torch import nn

from offloadd.runtime.compiled import unseen
from offloadd.tools.bench.hooks import saved_per_step

_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks


def _hooked(
    model: nn.Module, pair: tuple[Callable[..., Any], Callable[..., Any]] | None
) -> nn.Module:
    def pre(m: nn.Module, a: Any) -> None:
        if pair is not None:
            _push(*pair)

    def post(m: nn.Module, a: Any, o: Any) -> None:
        if pair is not None:
            _pop()

    for layer in model.layers:  # type: ignore[union-attr]
        layer.register_forward_pre_hook(unseen(pre))
        layer.register_forward_hook(unseen(post), always_call=True)
    return model


def main(argv: list[str] | None = None) -> int:
    ns = options(__doc__).parse_args(argv)
    plain = frozen_micro(ns)
    x = torch.randn(ns.batch, ns.width, requires_grad=True)
    per_layer = saved_per_step(plain, lambda m: m(x).square().mean()) / ns.blocks

    def ident(t: Any) -> Any:
        return t

    arms = {
        "plain": plain,
        "module hooks": _hooked(copy.deepcopy(plain), None),
        "python pair, unseen": _hooked(copy.deepcopy(plain), (unseen(ident), unseen(ident))),
        "python pair": _hooked(copy.deepcopy(plain), (ident, ident)),
        # a C method that gives back the tensor itself: Tensor.to() with nothing to convert to
        "C pair (Tensor.to)": _hooked(copy.deepcopy(plain), (torch.Tensor.to, torch.Tensor.to)),
    }

    def step(model: nn.Module) -> None:
        model(x).square().mean().backward()

    for model in arms.values():
        step(model)
    med = medians(arms, step, ns.rounds, ns.steps)
    hooks = (med["module hooks"] - med["plain"]) / ns.blocks * 1e6
    out: dict[str, Any] = {"plain_ms": med["plain"] * 1e3, "saved_per_layer": per_layer}
    print(f"plain {med['plain'] * 1e3:.3f} ms a step; {per_layer:.1f} saved tensors a layer")
    for k in arms:
        if k == "plain":
            continue
        us = (med[k] - med["plain"]) / ns.blocks * 1e6
        each = (us - hooks) / per_layer if k != "module hooks" else float("nan")
        out[k] = {"us_per_layer": us, "us_per_saved_tensor": each}
        print(f"{k:>20}: {us:6.1f} µs a layer above plain, {each:5.2f} µs a hooked saved tensor")
    return written(ns, out)


if __name__ == "__main__":
    raise SystemExit(main())
