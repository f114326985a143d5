"""What a point of the wall is made of: strategies and their variants at one batch, in rounds.

``offloadd wall`` measures the strategies as a user runs them. This script measures variants
beside them, to say why one strategy beats another at a size (the wall page's run H). Each
point trains in its own process inside its own memory cgroup, as the wall's do, on the wall's
goal model (HF GPT-2, 8 layers, d 512, seq 512, vocabulary 2000, AdamW, offloadd's host cache),
and the arms run in turn, reversed every other round. An arm is a strategy of the harness
(``none`` is plain) and options, comma-separated:

- ``cgroup=4``: the cgroup's limit in GiB (default ``--limit``), for a strategy that does not
  fit the limit, measured beside it (auto's budget still comes from ``--limit``);
- ``share=0.77``: auto's budget this share of what the limit leaves (the harness's
  ``CAP_SHARE``, 1/1.4, otherwise);
- ``blocks``: each transformer block compiled on its own (``block.compile()``), which auto's
  planner plans around (a model compiled whole it refuses);
- ``dir=/dev/shm/x``: offload there (tmpfs: the same writes and reads, no disk); made ready as
  offloadd's own directory options are (``offloadd/cli_dirs.py``).

Inductor's cache is the environment's (``TORCHINDUCTOR_CACHE_DIR``): a compiled arm's first
point compiles cold, later ones warm, which moves its peak, not its steps.

    python scripts/wall_parts.py --batch 4 --rounds 3 \\
        --arms none,cgroup=4 compile-budget auto auto,dir=/dev/shm/offloadd,cgroup=4

Prints each point as it ends and, per arm, the median of its rounds' samples/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

GIB = 1 << 30


def _options(arm: str) -> tuple[str, dict[str, str]]:
    strategy, *rest = arm.split(",")
    opts = dict(o.partition("=")[::2] for o in rest)
    unknown = set(opts) - {"cgroup", "share", "blocks", "dir"}
    if unknown:
        raise SystemExit(f"arm {arm!r}: unknown option {', '.join(sorted(unknown))}")
    for key in ("cgroup", "share"):
        if key in opts and not _positive(opts[key]):
            raise SystemExit(f"arm {arm!r}: {key} must be a positive number, got {opts[key]!r}")
    return strategy, opts


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _point(ns: argparse.Namespace, arm: str) -> dict[str, Any]:
    """One point, in this process (the child): the run's figures as a dict."""
    import offloadd.tools.harness.train as harness

    strategy, opts = _options(arm)
    if "share" in opts:
        harness.CAP_SHARE = float(opts["share"])
    if "blocks" in opts:
        build = harness.build_model

        def build_blocks(*args: Any, **kwargs: Any) -> Any:
            built = build(*args, **kwargs)
            for block in built.module.transformer.h:
                block.compile()
            return built

        harness.build_model = build_blocks  # type: ignore[assignment]
    spec = harness.RunSpec(
        strategy=strategy,
        model="gpt",
        num_layers=8,
        d_model=512,
        num_heads=8,
        seq_len=512,
        vocab_size=2000,
        batch_size=ns.batch,
        steps=ns.steps,
        warmup=1,
        ssd_dir=opts.get("dir", ns.ssd_dir),
        memory_cap_bytes=int(ns.limit * GIB),
        allocator="caching",
    )
    res = harness.run(spec)
    plan = res.get("plan")
    return {
        "step_s": res["step_time_s"],
        "steps_s": res["step_times_s"],
        "samples_per_s": ns.batch / res["step_time_s"],
        "plan": harness.plan_counts(plan) if plan else None,
        "budget_mib": round(plan["budget_bytes"] / 2**20, 1) if plan else None,
        "steal_s": res.get("steal_s"),
    }


def _spawn(ns: argparse.Namespace, arm: str) -> dict[str, Any]:
    from offloadd.tools.harness.cgroup import memory_cgroup

    _, opts = _options(arm)
    limit = int(float(opts.get("cgroup", ns.limit)) * GIB)
    args = [sys.executable, __file__, "--point", arm, "--batch", str(ns.batch)]
    args += ["--steps", str(ns.steps), "--limit", str(ns.limit)]
    if ns.ssd_dir:
        args += ["--ssd-dir", ns.ssd_dir]
    with memory_cgroup(limit, prefix="wall-parts") as cg:
        p = subprocess.run(args, preexec_fn=cg.enter, capture_output=True, text=True)
        out: dict[str, Any] = {"arm": arm, "cgroup_gib": limit / GIB}
        out["peak_mib"] = round(cg.peak() / 2**20)
        out["oom"] = cg.oom_killed()
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode == 0 and lines:
        out.update(json.loads(lines[-1]))
    else:
        out["error"] = (p.stderr.strip().splitlines() or ["?"])[-1]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--arms", nargs="+", default=["none", "auto"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps a point (default 4)")
    p.add_argument("--limit", type=float, default=2, help="the limit in GiB (default 2)")
    p.add_argument("--ssd-dir", default=None, help="offload directory (default: offloadd's)")
    p.add_argument("--json", default=None, help="write every point here")
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)  # the child's arm
    ns = p.parse_args()
    if ns.point is not None:
        print(json.dumps(_point(ns, ns.point)), flush=True)
        return
    from offloadd.cli_dirs import ready_dir
    from offloadd.tools.harness.train import STRATEGIES

    for arm in ns.arms:  # refuse a bad arm before the first point runs
        strategy, opts = _options(arm)
        if strategy not in STRATEGIES:
            raise SystemExit(f"arm {arm!r}: strategy must be one of {', '.join(STRATEGIES)}")
        for option, path in (("--ssd-dir", ns.ssd_dir), (f"{arm}: dir", opts.get("dir"))):
            if path:
                try:
                    ready_dir(option, path)  # created 0700 if missing, as offloadd's options are
                except ValueError as e:
                    raise SystemExit(str(e)) from None
    points: list[dict[str, Any]] = []
    for r in range(ns.rounds):
        for arm in ns.arms if r % 2 == 0 else reversed(ns.arms):
            pt = _spawn(ns, arm) | {"round": r + 1}
            points.append(pt)
            what = pt.get("error") or (
                f"{pt['samples_per_s']:.3f} samples/s, steps {min(pt['steps_s']):.2f}-"
                f"{max(pt['steps_s']):.2f} s, plan {pt['plan']}"
            )
            print(f"round {r + 1} {arm}: peak {pt['peak_mib']} MiB, {what}", flush=True)
    for arm in ns.arms:
        got = [x["samples_per_s"] for x in points if x["arm"] == arm and "samples_per_s" in x]
        if got:
            print(
                f"{arm}: median {statistics.median(got):.3f} samples/s over {len(got)} rounds "
                f"({min(got):.3f}-{max(got):.3f})"
            )
    if ns.json:
        with open(ns.json, "w") as f:
            head = {"batch": ns.batch, "limit_gib": ns.limit, "steps": ns.steps}
            json.dump(head | {"points": points}, f, indent=1)


if __name__ == "__main__":
    main()
