"""``offloadd wall``: how large a job trains inside a hard memory limit, per strategy.

For a model and a limit, each strategy's batch size (or, ``--grow seq``, sequence length) is
grown until it no longer trains (search.py: doubling, then bisection), each point trained for a
few steps in its own process inside a memory cgroup of the limit (points.py), so an
out-of-memory is the kernel's, not a guess. Points go to ``OUT/wall.csv`` as they finish; the
walls, the spec and the machine to ``OUT/wall.json``; the figure to ``OUT/wall.png``. Needs a
memory cgroup: root, or a delegated cgroup v2 subtree (it says so where it has neither).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from offloadd.cli_dirs import ready_dir
from offloadd.config import parse_size
from offloadd.tools.harness.cgroup import CgroupUnavailable, memory_cgroup
from offloadd.tools.harness.machine import describe_machine, machine_line
from offloadd.tools.harness.peers import unavailable
from offloadd.tools.models.build import MODELS
from offloadd.tools.wall.points import STRATEGIES, WallSpec, measure, point_line, write_rows
from offloadd.tools.wall.predicted import Predictor, columns, error_lines
from offloadd.tools.wall.search import Wall, find_wall
from offloadd.tools.wall.summary import contested, summary
from offloadd.units import format_bytes

__all__ = ["DEFAULT_STRATEGIES", "UsageError", "add_arguments", "main"]

DEFAULT_STRATEGIES = ("plain", "recompute", "offload-ssd", "auto")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Find each strategy's wall: the largest batch (or sequence) that trains inside a hard "
        "memory limit, every point in its own process inside a memory cgroup of the limit."
    )
    p.add_argument("--memory-limit", required=True, help="the hard limit, e.g. 2GiB")
    p.add_argument(
        "--model",
        default="gpt",
        choices=MODELS,
        help="gpt (HF GPT-2, default), bert, t5 (transformers, random weights) or mini-gpt",
    )
    p.add_argument(
        "--hf-config",
        default=None,
        metavar="DIR",
        help="instead of --model: the causal LM of a transformers config.json in DIR (as "
        "save_pretrained writes it: GPT-2, Llama, Mistral, Qwen2, Mixtral, ...), random "
        "weights; its sizes are the config's",
    )
    p.add_argument("--layers", type=int, default=8, help="blocks (default 8)")
    p.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    p.add_argument("--vocab", type=int, default=2000, help="vocabulary (default 2000)")
    p.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help=f"comma-separated from {', '.join(STRATEGIES)} (default: "
        f"{','.join(DEFAULT_STRATEGIES)})",
    )
    p.add_argument(
        "--grow", choices=("batch", "seq"), default="batch", help="what grows (default batch)"
    )
    p.add_argument("--batch", type=int, default=1, help="the batch size while --grow seq")
    p.add_argument("--start", type=int, default=None, help="first size (default 1; seq: 64)")
    p.add_argument(
        "--most", type=int, default=None, help="largest size tried (default 4096; seq: 65536)"
    )
    p.add_argument(
        "--tolerance", type=int, default=1, help="bisect until the wall is this close (1)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each size two or more strategies train this many times in all, the "
        "strategies in turn (reversed every other round), and compare their medians (default 1: "
        "the search's points only, which may run far apart in time)",
    )
    p.add_argument("--steps", type=int, default=2, help="timed steps per point (default 2)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed steps per point first (default 1)"
    )
    p.add_argument(
        "--ssd-dir",
        default=None,
        help="offload directory, created (mode 0700) if missing (default: per-user dir)",
    )
    p.add_argument("--out", default="wall", help="output directory (default: ./wall)")
    p.add_argument(
        "--point-timeout", type=float, default=None, help="seconds before a point is abandoned"
    )
    p.add_argument("--no-plot", action="store_true", help="skip wall.png (no matplotlib needed)")
    p.add_argument(
        "--no-predict",
        action="store_true",
        help="leave predicted_peak_bytes empty (saves a trace of a few seconds per point)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default; the limit is a memory cgroup) or cuda (the limit is device memory: "
        "a per-process fraction of the GPU's)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the model's parameters' dtype (default float32; bfloat16 on a GPU)",
    )
    p.add_argument(
        "--allocator",
        choices=("held", "system"),
        default="held",
        help="torch's CPU allocator on cpu: held (default): offloadd's host cache for every "
        "strategy, so that a peak is the strategy's, not the allocator's; system: glibc's heap "
        "where the strategy has no Offloader (as plain PyTorch runs)",
    )
    p.add_argument(
        "--host-memory-limit",
        default=None,
        help="with --device cuda: a memory cgroup of this size around each point too",
    )


class UsageError(ValueError):
    """A bad option, named."""


def _resolve(ns: argparse.Namespace) -> tuple[WallSpec, list[str], int, int, Path]:
    try:
        limit = parse_size("--memory-limit", ns.memory_limit)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if limit <= 0:
        raise UsageError(f"--memory-limit must be positive, got {ns.memory_limit!r}")
    names = [s.strip() for s in ns.strategies.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise UsageError(
            f"--strategies must list names from {', '.join(STRATEGIES)}, got {ns.strategies!r}"
        )
    if ns.device not in ("cpu", "cuda") and not ns.device.startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda, got {ns.device!r}")
    for s in names:
        why = unavailable(STRATEGIES[s], ns.device)
        if why is not None:
            raise UsageError(f"--strategies: {why}")
    host_limit = 0
    if ns.host_memory_limit is not None:
        if ns.device == "cpu":
            raise UsageError("--host-memory-limit is for --device cuda (on cpu: --memory-limit)")
        try:
            host_limit = parse_size("--host-memory-limit", ns.host_memory_limit)
        except ValueError as e:
            raise UsageError(str(e)) from None
    for opt in ("layers", "hidden", "heads", "seq", "batch", "steps", "tolerance", "rounds"):
        if getattr(ns, opt) <= 0:
            raise UsageError(f"--{opt} must be positive, got {getattr(ns, opt)}")
    if ns.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {ns.warmup}")
    seq = ns.grow == "seq"
    start = ns.start if ns.start is not None else (64 if seq else 1)
    most = ns.most if ns.most is not None else (65536 if seq else 4096)
    if not 1 <= start <= most:
        raise UsageError(f"--start and --most need 1 <= start <= most, got {start} and {most}")
    try:
        out = ready_dir("--out", ns.out)
        if ns.ssd_dir:
            ready_dir("--ssd-dir", ns.ssd_dir)
    except ValueError as e:
        raise UsageError(str(e)) from None
    described = None
    if ns.hf_config is not None:
        from offloadd.tools.models.hf_config import (
            HFConfigError,
            check_seq,
            load_config,
            shape_of,
        )

        try:
            config = load_config(ns.hf_config)
            shape = shape_of(config)
            if ns.grow == "batch":
                check_seq(config, ns.seq)
        except (HFConfigError, ImportError) as e:
            raise UsageError(str(e)) from None
        described = (config.model_type, shape)
    spec = WallSpec(
        model=ns.model,
        layers=ns.layers,
        hidden=ns.hidden,
        heads=ns.heads,
        seq=ns.seq,
        vocab=ns.vocab,
        batch=ns.batch,
        limit=limit,
        steps=ns.steps,
        warmup=ns.warmup,
        ssd_dir=ns.ssd_dir,
        point_timeout=ns.point_timeout,
        hf_config=ns.hf_config,
        device=ns.device,
        dtype=ns.dtype,
        host_limit=host_limit,
        allocator=_allocator(ns.allocator, ns.device),
    )
    if described is not None:  # the config's sizes, for the title and wall.json
        spec.model, shape = described
        spec.layers, spec.hidden, spec.vocab = shape["layers"], shape["hidden"], shape["vocab"]
    return spec, list(dict.fromkeys(names)), start, most, out


def _allocator(choice: str, device: str) -> str:
    """The runs' ``RunSpec.allocator``: on cpu, ``held`` is the one bench step and the demo hold
    equal (the host cache where it is built); ``system`` and any GPU run keep each strategy's
    own."""
    if choice == "system" or device != "cpu":
        return "auto"
    from offloadd.tools.harness.step_trace import cpu_allocator

    return cpu_allocator()


def _check_gpu(spec: WallSpec) -> None:
    """A GPU to limit: there, and with more memory than the limit."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"--device {spec.device}: no CUDA device here (torch {torch.__version__})")
    total = torch.cuda.get_device_properties(torch.device(spec.device)).total_memory
    if spec.limit > total:
        raise UsageError(
            f"--memory-limit {format_bytes(spec.limit)} is more than {spec.device}'s "
            f"{format_bytes(total)}"
        )


def main(ns: argparse.Namespace) -> int:
    try:
        spec, strategies, start, most, out = _resolve(ns)
    except UsageError as e:
        print(f"offloadd wall: {e}", file=sys.stderr)
        return 2
    on_gpu = spec.device != "cpu"
    try:  # before any point: a limit that cannot be enforced is said at once
        if not on_gpu or spec.host_limit:
            with memory_cgroup(spec.host_limit or spec.limit, prefix="offloadd-wall"):
                pass
        if on_gpu:
            _check_gpu(spec)
    except (CgroupUnavailable, UsageError) as e:
        print(f"offloadd wall: {e}", file=sys.stderr)
        return 2
    # compiled points (compile-budget) share an inductor cache of this run's own
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(out / "inductor-cache"))
    machine = describe_machine("cuda" if on_gpu else "cpu", spec.ssd_dir)
    grow = ns.grow
    title = (
        f"{spec.model} {spec.layers}L d{spec.hidden} "
        + (f"seq {spec.seq}" if grow == "batch" else f"batch {spec.batch}")
        + f" in {format_bytes(spec.limit)}"
        + (f" of {spec.device} memory, {spec.dtype}" if on_gpu else "")
    )
    print(f"offloadd wall: {title}; growing the {grow} from {start}; {machine_line(machine)}")
    rows: list[dict[str, Any]] = []
    walls: dict[str, Wall] = {}
    csv_path = out / "wall.csv"
    started = time.time()
    predictor = Predictor(spec, on=not ns.no_predict)

    def status_of(s: str, size: int, round: int = 0) -> str:
        batch, seq = (size, spec.seq) if grow == "batch" else (spec.batch, size)
        again = f" (round {round + 1} of {ns.rounds})" if round else ""
        print(f"  {s} {grow} {size}{again} ...", file=sys.stderr, flush=True)
        predicted = columns(predictor(s, batch, seq))
        row = {**measure(spec, s, batch, seq), **predicted, "round": round}
        rows.append(row)
        write_rows(csv_path, rows)
        print(point_line(row, grow) + again, flush=True)
        return str(row["status"])

    for s in strategies:
        walls[s] = find_wall(functools.partial(status_of, s), start, most, ns.tolerance)
    key = "batch_size" if grow == "batch" else "seq_len"
    for size, names in contested(rows, key).items() if ns.rounds > 1 else ():
        for r in range(1, ns.rounds):
            for s in names if r % 2 == 0 else names[::-1]:
                status_of(s, size, r)
    lines = summary(walls, rows, grow) + error_lines(rows)
    doc = {
        "title": title,
        "grow": grow,
        "spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
        "walls": {
            s: {
                "largest": w.largest,
                "smallest_failed": w.smallest_failed,
                "failed_as": w.failed_as,
            }
            for s, w in walls.items()
        },
        "machine": machine,
        "rounds": ns.rounds,
        "seconds": round(time.time() - started, 1),
    }
    (out / "wall.json").write_text(json.dumps(doc, indent=1) + "\n")
    wrote = [csv_path, out / "wall.json"]
    if not ns.no_plot:
        from offloadd.tools.wall.plot import plot

        plot(rows, grow, out / "wall.png", f"{title}; {machine_line(machine)}")
        wrote.append(out / "wall.png")
    print()
    print("\n".join(lines))
    print(f"\nwrote {', '.join(map(str, wrote))}")
    return 1 if any(r["status"] == "error" for r in rows) else 0
