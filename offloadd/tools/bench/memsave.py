"""``offloadd bench memsave``: saved-activation bytes and step time of plain, memsave and memsave
with ssd offload, on frozen-backbone fine-tunes.

Scenarios (transformers models, random weights; no downloads):

- ``bn-tuning``: ResNet-101, convolutions frozen, BatchNorm affine and the head trainable, train
  mode. Target: memsave's saved bytes <= 0.6 x plain, step time <= 1.02 x plain.
- ``saliency``: the same ResNet frozen, eval mode, the input requires grad. Target: <= 0.1 x.
- ``vit-tuning``: ViT-Base, weights frozen, LayerNorm and bias parameters trainable. Reported.
- ``full``: ResNet-101, everything trainable (memsave should change little).

Saved bytes are counted by a pack hook: the distinct storages saved in one forward, parameters
excluded, all alive when backward starts (deterministic, no RSS noise). With offload (a second
pack hook cannot run beside the Offloader's): memsave's count less the Offloader's
``offloaded_bytes`` per step, i.e. what stays in memory once the writes completed (tensors below
``--min-bytes`` are kept). Step time (forward, loss,
backward) is the median over ``--steps`` after ``--warmup``, the configurations interleaved
step by step in one process, so drift hits them alike, in an order reversed every round (the
step after a plain one otherwise starts with its gigabyte just freed). A configuration's "x plain"
is the median of its per-round ratios to plain's step of the same round. ``--control`` adds a
deep copy of the plain model as a fourth configuration: its ratio is the measurement's own
noise and bias, to read the others against. Example (the docs/benchmarks run):

    offloadd bench memsave --image-size 128 --batch 4 --steps 5

Note: [page faults]
~~~~~~~~~~~~~~~~~~~
On a virtual machine, a step's time can depend as much on page faults as on the work: glibc
gives large freed blocks back to the kernel, and the next allocation of that memory faults every
page in again (zeroed by the kernel: about as dear as writing it twice, more under a hypervisor).
Which steps fault, and how much, depends on the order of allocations and frees, so it differs by
configuration and from run to run, and step times follow the faults
(docs/benchmarks/memsave_kernels_cpu-2core_2026-11-24.md). The report gives the median faults
per step next to each time. ``--keep-freed-memory`` sets glibc's thresholds so that freed memory
stays in the process (``keep_freed_memory``): after warm-up no
configuration faults, and the times compare the work alone.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offloadd.cli_dirs import ready_dir, ready_parent
from offloadd.memsave import memsave
from offloadd.offloader import Offloader
from offloadd.tools.harness.machine import command_line
from offloadd.tools.models.hf import require_transformers

__all__ = [
    "Logits",
    "CONFIGS",
    "CONTROL",
    "HELP",
    "SCENARIOS",
    "TARGETS",
    "add_arguments",
    "count_saved_bytes",
    "format_report",
    "keep_freed_memory",
    "main",
    "run_scenario",
]

HELP = "saved bytes and step time of plain, memsave and memsave + ssd offload (frozen backbones)"

SCENARIOS = ("bn-tuning", "saliency", "vit-tuning", "full")
CONFIGS = ("plain", "memsave", "memsave+offload")
CONTROL = "plain (copy)"
"""The plain model's deep copy, with ``--control``."""
TARGETS = {"bn-tuning": (0.6, 1.02), "saliency": (0.1, None)}
"""scenario -> (saved-bytes ratio, step-time ratio) targets of memsave against plain."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    p.add_argument("--image-size", type=int, default=64, help="ResNet input side (pixels)")
    p.add_argument("--vit-image-size", type=int, default=64, help="ViT input side (pixels)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--resnet-depths", default="3,4,23,3", help="blocks per stage (101: 3,4,23,3)")
    p.add_argument("--vit-layers", type=int, default=12)
    p.add_argument("--vit-hidden", type=int, default=768)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--ssd-dir",
        default=None,
        help="offload directory, created (mode 0700) if missing (default: offloadd's)",
    )
    p.add_argument(
        "--min-bytes", type=int, default=1 << 20, help="the Offloader's min_bytes (default 1 MiB)"
    )
    p.add_argument("--no-offload", action="store_true", help="skip memsave+offload")
    p.add_argument(
        "--control", action="store_true", help="also time a copy of plain (the noise floor)"
    )
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc keeps freed memory for reuse (no page faults after warm-up; see the docs)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="also write the markdown report here (its directory created, mode 0700, if missing)",
    )


# -- models --------------------------------------------------------------------------------


class Logits(nn.Module):
    """An image classifier of transformers as ``pixels -> logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(pixel_values=x).logits
        return out


def _resnet(depths: list[int]) -> nn.Module:
    tf = require_transformers()
    cfg = tf.ResNetConfig(depths=depths, layer_type="bottleneck", num_labels=10)
    return Logits(tf.ResNetForImageClassification(cfg))


def _vit(ns: argparse.Namespace) -> nn.Module:
    tf = require_transformers()
    heads = max(1, ns.vit_hidden // 64)
    cfg = tf.ViTConfig(
        image_size=ns.vit_image_size,
        patch_size=16,
        hidden_size=ns.vit_hidden,
        num_hidden_layers=ns.vit_layers,
        num_attention_heads=heads,
        intermediate_size=4 * ns.vit_hidden,
        num_labels=10,
    )
    return Logits(tf.ViTForImageClassification(cfg))


def _build(scenario: str, ns: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, bool]:
    """The model with its trainable parameters set, an input, whether the input requires grad."""
    torch.manual_seed(0)
    depths = [int(d) for d in ns.resnet_depths.split(",") if d]
    if scenario == "vit-tuning":
        model = _vit(ns).train()
        for name, p in model.named_parameters():
            p.requires_grad_("layernorm" in name or name.endswith("bias"))
        side = ns.vit_image_size
    else:
        model = _resnet(depths)
        for mod in model.modules():
            for p in mod.parameters(recurse=False):
                if scenario == "full":
                    p.requires_grad_(True)
                elif scenario == "saliency":
                    p.requires_grad_(False)
                else:  # bn-tuning: convolutions frozen, the rest trainable
                    p.requires_grad_(not isinstance(mod, nn.Conv2d))
        model.train(scenario != "saliency")
        side = ns.image_size
    x = torch.randn(ns.batch, 3, side, side, generator=torch.Generator().manual_seed(1))
    return model, x, scenario == "saliency"


# -- measuring -----------------------------------------------------------------------------


@contextmanager
def count_saved_bytes(model: nn.Module) -> Iterator[list[int]]:
    """Bytes of the distinct storages saved for backward inside (the model's parameters
    excluded); the list's one element is updated as tensors are saved."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = s.nbytes()
            total[0] += s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def _step(
    model: nn.Module, x: torch.Tensor, x_grad: bool, ctx: AbstractContextManager[Any]
) -> tuple[float, int]:
    """Seconds and page faults (minor: memory the kernel mapped fresh) of one step."""
    leaf = x.detach().requires_grad_(x_grad)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    with ctx:
        out = model(leaf)
    out.float().square().mean().backward()
    elapsed = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    model.zero_grad(set_to_none=True)
    return elapsed, faults


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory for reuse instead of giving it back to the kernel
    (Note [page faults]): allocations up to 32 MiB (its maximum) come from the heap, which is
    never trimmed. Raises ``OSError`` where glibc's ``mallopt`` is missing."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not libc.mallopt(m_mmap_threshold, 32 << 20) or not libc.mallopt(
        m_trim_threshold, 2**31 - 1
    ):
        raise OSError("mallopt refused the thresholds")


def run_scenario(scenario: str, ns: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per configuration: ``saved_bytes`` and ``step_s`` (median)."""
    plain, x, x_grad = _build(scenario, ns)
    ms = memsave(copy.deepcopy(plain))
    configs = [c for c in CONFIGS if not (ns.no_offload and c.endswith("offload"))]
    models = {"plain": plain, "memsave": ms, "memsave+offload": ms}
    if ns.control:
        configs.append(CONTROL)
        models[CONTROL] = copy.deepcopy(plain)
    results: dict[str, dict[str, float]] = {c: {} for c in configs}
    for c in [k for k in configs if k != "memsave+offload"]:  # with offload: counted below
        with count_saved_bytes(models[c]) as counted:
            out = models[c](x.detach().requires_grad_(x_grad))
        results[c]["saved_bytes"] = counted[0]
        out.float().square().mean().backward()
        models[c].zero_grad(set_to_none=True)
        del out
    off: Offloader | None = None
    if "memsave+offload" in configs:
        kw: dict[str, Any] = {"tier": "ssd", "min_bytes": ns.min_bytes}
        if ns.ssd_dir:
            kw["ssd_dirs"] = [ns.ssd_dir]
        off = Offloader(**kw)
        off.note_module(ms)
    times: dict[str, list[float]] = {c: [] for c in configs}
    faults: dict[str, list[int]] = {c: [] for c in configs}
    try:
        for step in range(ns.warmup + ns.steps):
            for c in configs if step % 2 == 0 else configs[::-1]:
                ctx: AbstractContextManager[Any] = nullcontext()
                if c.endswith("offload") and off is not None:
                    ctx = off
                t, f = _step(models[c], x, x_grad, ctx)
                if step >= ns.warmup:
                    times[c].append(t)
                    faults[c].append(f)
        if off is not None:
            off.synchronize()
            moved = off.stats().offloaded_bytes / (ns.warmup + ns.steps)
            kept = max(0.0, results["memsave"]["saved_bytes"] - moved)
            results["memsave+offload"].update(saved_bytes=kept, offloaded_bytes=moved)
    finally:
        if off is not None:
            off.close()
    for c in configs:
        results[c]["step_s"] = statistics.median(times[c])
        paired = [t / p for t, p in zip(times[c], times["plain"], strict=True)]
        results[c]["step_ratio"] = statistics.median(paired)
        results[c]["faults"] = statistics.median(faults[c])
    return results


# -- report --------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _speed(r: dict[str, float], base: dict[str, float]) -> float:
    """The median of the per-round ratios to plain (or, without them, the medians' ratio)."""
    return r["step_ratio"] if "step_ratio" in r else r["step_s"] / base["step_s"]


def format_report(all_results: dict[str, dict[str, dict[str, float]]], header: list[str]) -> str:
    lines = [*header, ""]
    for scenario, res in all_results.items():
        base = res["plain"]
        lines += [
            f"### {scenario}",
            "",
            "| configuration | saved bytes in memory | x plain | offloaded per step | step time "
            "| x plain (paired) | page faults per step |",
            "|---|---|---|---|---|---|---|",
        ]
        for c, r in res.items():
            moved = _mib(r["offloaded_bytes"]) if "offloaded_bytes" in r else "-"
            lines.append(
                f"| {c} | {_mib(r['saved_bytes'])} ({int(r['saved_bytes'])} B) | "
                f"{r['saved_bytes'] / max(base['saved_bytes'], 1):.3f} | {moved} | "
                f"{r['step_s']:.3f} s | {_speed(r, base):.3f} | {r.get('faults', 0):.0f} |"
            )
        ratio = res["memsave"]["saved_bytes"] / max(base["saved_bytes"], 1)
        speed = _speed(res["memsave"], base)
        target = TARGETS.get(scenario)
        verdict = f"memsave / plain: saved bytes {ratio:.3f}, step time {speed:.3f}"
        if target is not None:
            bytes_ok = "met" if ratio <= target[0] else "NOT met"
            verdict += f"; target saved bytes <= {target[0]}: {bytes_ok}"
            if target[1] is not None:
                time_ok = "met" if speed <= target[1] else "NOT met"
                verdict += f"; target step time <= {target[1]}: {time_ok}"
        lines += ["", verdict, ""]
    return "\n".join(lines)


def _options(ns: argparse.Namespace) -> list[str]:
    scenarios = [s for s in ns.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            raise ValueError(f"--scenarios: unknown {s!r}; known: {', '.join(SCENARIOS)}")
    if not scenarios:
        raise ValueError("--scenarios: give at least one")
    if ns.steps < 1 or ns.warmup < 0:
        raise ValueError("--steps must be at least 1 and --warmup at least 0")
    require_transformers()
    # last, so that a bad option creates nothing (Note [directories of the command line])
    if ns.ssd_dir:
        ready_dir("--ssd-dir", ns.ssd_dir)
    if ns.out:
        ready_parent("--out", ns.out)
    return scenarios


def main(ns: argparse.Namespace) -> int:
    try:
        scenarios = _options(ns)
    except (ValueError, ImportError) as e:
        print(f"offloadd bench memsave: {e}", file=sys.stderr)
        return 2
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.keep_freed_memory:
        try:
            keep_freed_memory()
        except OSError as e:
            print(f"offloadd bench memsave: --keep-freed-memory: {e}", file=sys.stderr)
            return 2
    header = [
        "## offloadd bench memsave",
        "",
        f"- command: `{command_line()}`",
        f"- torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"- ResNet depths {ns.resnet_depths}, image {ns.image_size}; ViT {ns.vit_layers} layers, "
        f"hidden {ns.vit_hidden}, image {ns.vit_image_size}; batch {ns.batch}; "
        f"{ns.steps} timed steps after {ns.warmup} warm-up",
        "- glibc keeps freed memory (--keep-freed-memory)"
        if ns.keep_freed_memory
        else "- glibc's default malloc settings",
    ]
    results: dict[str, dict[str, dict[str, float]]] = {}
    for s in scenarios:
        results[s] = run_scenario(s, ns)
        print(f"{s}: done", file=sys.stderr, flush=True)
    report = format_report(results, header)
    print(report)
    if ns.out:
        Path(ns.out).write_text(report + "\n")
    return 0
