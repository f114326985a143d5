"""Two builds of offloadd's C hooks (``offloadd.runtime._held``) in one process: the installed
one and another (``--other``, a build of csrc/hot_path/ from another commit, with the
flags setup.py gives it: Python's CFLAGS, then ``-O2 -std=gnu11``), each arm of
``offloadd bench hooks`` run with each, round by round, so that the machine's drift hits both
alike, with the same ``none`` and ``noop`` for both. Paired processes cannot resolve a few
per cent here: the no-op arm alone moved from 1.22 to 1.64 µs a tensor between processes
(docs/benchmarks/hooks-round4_cpu-2core_2026-12-06.md).

    mkdir -p /tmp/old && git archive OLD csrc/hot_path | tar -x -C /tmp/old
    cc $(python -c 'import sysconfig; print(sysconfig.get_config_var("CFLAGS"))') -fPIC -O2 -std=gnu11 \
        -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" -shared \
        /tmp/old/csrc/hot_path/*.c -o /tmp/old/_held$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    python scripts/held_ab.py --other /tmp/old/_held.cpython-311-x86_64-linux-gnu.so --rounds 60

Each arm is a tier of ``offloadd bench hooks`` (``keep-all``, ``keep``, ``ssd``); ``ARM`` runs
the installed build and ``ARM@other`` the other, beside ``none`` and ``noop``. Prints µs per
saved tensor above ``none`` and the ratio to ``noop`` (``--model micro``), or the step against
``none`` (``--model gpt2``), and the other's against the installed build's; ``--json`` writes
the step times.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from offloadd.offloader import Offloader
from offloadd.runtime import held
from offloadd.tools.bench.hooks import _gpt2, _interleave, micro_model, saved_per_step
from offloadd.tools.bench.hooks_arms import open_arms, tier_kwargs

ARMS = ("keep-all", "keep", "ssd")


def load_other(path: str) -> ModuleType:
    """The build at ``path``, as a module of its own beside the installed one."""
    spec = importlib.util.spec_from_file_location("held_ab_other._held", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--other {path}: not a module Python can load")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def using(module: ModuleType | None) -> Iterator[None]:
    """offloadd's hooks made from ``module``'s classes while inside (None: the installed)."""
    if module is None:
        yield
        return
    saved = held.Tally, held.Held, held.Pack, held.Unpack
    held.Tally, held.Held = module.Tally, module.Held
    held.Pack, held.Unpack = module.Pack, module.Unpack
    try:
        yield
    finally:
        held.Tally, held.Held, held.Pack, held.Unpack = saved


def offloader(arm: str, module: ModuleType | None, workdir: Path) -> Offloader:
    with using(module):  # its tally is made now, from module's Tally
        return Offloader(**tier_kwargs(arm, workdir))


def step_of(
    model: nn.Module,
    loss_of: Callable[[nn.Module], torch.Tensor],
    scope: Callable[[], contextlib.AbstractContextManager[Any]],
    module: ModuleType | None,
) -> Callable[[], None]:
    def step() -> None:
        with using(module):
            with scope():  # the pair is made at entry, from module's classes
                loss = loss_of(model)
            loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--other", required=True, help="another build of offloadd.runtime._held")
    p.add_argument("--model", choices=("micro", "gpt2"), default="micro")
    p.add_argument("--arms", default="keep-all,keep", help=f"from {','.join(ARMS)}")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps", type=int, default=5, help="steps a round and arm")
    p.add_argument("--json", type=Path)
    ns = p.parse_args()
    arms = [a for a in ns.arms.split(",") if a]
    if set(arms) - set(ARMS):
        raise SystemExit(f"--arms: unknown {sorted(set(arms) - set(ARMS))}; choose from {ARMS}")
    if not held.NATIVE:
        raise SystemExit("offloadd.runtime._held is not built here (docs/native.md)")
    other = load_other(ns.other)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if ns.model == "micro":
        model = micro_model(64, 64)
        x = torch.randn(8, 64)

        def loss_of(m: nn.Module) -> torch.Tensor:
            return m(x).square().mean()

    else:
        model, loss_of = _gpt2("cpu")
    saved = saved_per_step(model, loss_of)
    with (
        tempfile.TemporaryDirectory(dir="/var/tmp") as tmp,
        open_arms(["none", "noop"], Path(tmp), "0.5x", "cpu") as base,
        contextlib.ExitStack() as stack,
    ):
        workdir = Path(tmp)
        steps = {a.name: step_of(model, loss_of, a.scope, None) for a in base}
        for arm in arms:
            for name, module in ((arm, None), (f"{arm}@other", other)):
                off = offloader(arm, module, workdir)
                stack.callback(off.close)
                steps[name] = step_of(model, loss_of, lambda off=off: off, module)
        times = _interleave(steps, ns.rounds, ns.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    base, noop = med["none"], med["noop"] - med["none"]
    print(f"{ns.model}: {saved} saved tensors a step; none {base * 1e3:.3f} ms a step")
    for name, m in med.items():
        us = (m - base) / saved * 1e6
        line = f"{name:16s} {m * 1e3:8.3f} ms  x none {m / base:.3f}  {us:6.2f} us/saved"
        if name not in ("none", "noop"):
            line += f"  x noop {(m - base) / noop:.2f}"
        if name.endswith("@other"):
            line += f"  (other / installed: {m / med[name.removesuffix('@other')]:.3f})"
        print(line)
    if ns.json:
        doc = {
            "model": ns.model,
            "saved_per_step": saved,
            "other": ns.other,
            "steps_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
        }
        ns.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
