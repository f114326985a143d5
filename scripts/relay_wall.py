"""The memory wall: an HF Llama fine-tune whose frozen weights are more than twice a hard memory
limit, relayed from its checkpoint inside the limit, against the model loaded whole.

A checkpoint is written with ``save_pretrained`` (random weights, fp32, 200 MB shards). Each
fine-tune (``lora``: rank-8 adapters on every q and v projection, the base frozen; ``head``:
only the LM head) runs as a subprocess (tests/_support/relay_wall.py):

- ``whole``: ``from_pretrained``, no limit: the reference;
- ``relay``: built on the meta device, ``offloadd.relay(model, checkpoint=...)`` (tier ssd),
  inside a memory cgroup of ``--limit-mib`` (swap off);
- ``whole, then relay``: ``from_pretrained``, then ``offloadd.relay(model)`` (what
  ``OFFLOADD_RELAY=frozen`` does in a script that loads the model itself), in the same limit;
- ``whole``: ``from_pretrained`` in the same limit. transformers maps safetensors files: weights
  loaded as stored are clean file pages the kernel may drop and read again at the next touch;
  a dtype asked for (``bfloat16`` of an fp32 file) makes copies.

Each limited run starts with the checkpoint's page cache dropped.

It reports the cgroup's peak during load and during the steps, each step's time, the bytes
relay read a step, and whether the losses and trained tensors are bit-identical to ``whole``.
Needs root (it makes its own cgroups).

    python scripts/relay_wall.py --out docs/benchmarks/relay-wall_llama-34_cpu-2core_DATE
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MIB = 1 << 20


def _run(
    ckpt: Path, out: Path, mode: str, train: str, disk: Path, steps: int, limit: int, dtype: str
) -> dict:
    import torch

    from offloadd.tools.harness.cgroup import memory_cgroup

    cmd = [sys.executable, "-m", "tests._support.relay_wall", str(ckpt), str(out)]
    cmd += ["--mode", mode, "--train", train, "--ssd-dir", str(disk), "--steps", str(steps)]
    cmd += ["--dtype", dtype] if dtype else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    if not limit:
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        doc = json.loads(out.read_text())
    else:
        for f in ckpt.glob("*.safetensors"):  # the page cache a run meets is its own
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        with memory_cgroup(limit) as cg:
            run = subprocess.run(
                cmd,
                cwd=ROOT,
                env=dict(env, RELAY_WALL_CGROUP=str(cg.path)),
                preexec_fn=cg.enter,
                capture_output=True,
                text=True,
            )
            if run.returncode != 0:
                return {"mode": mode, "exit": run.returncode, "oom_killed": cg.oom_killed()}
            doc = json.loads(out.read_text())
            doc["peak"] = cg.peak()
    doc["trained"] = torch.load(str(out) + ".pt")
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=34)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--limit-mib", type=int, default=450)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dir", default="/var/tmp", help="where the checkpoint and the store go")
    p.add_argument("--out", help="write OUT.md and OUT.json")
    a = p.parse_args()
    import torch

    from tests._support.relay_wall import save_checkpoint

    limit = a.limit_mib * MIB
    work = Path(tempfile.mkdtemp(prefix="relay-wall-", dir=a.dir))
    frozen = save_checkpoint(work / "ckpt", a.layers, a.hidden, a.ffn)
    rows = []
    for train, dtype in (("lora", ""), ("head", ""), ("lora", "bfloat16")):
        tag = f"{train}-{dtype or 'stored'}"
        ref = _run(
            ckpt := work / "ckpt",
            work / f"{tag}-whole.json",
            "whole",
            train,
            work,
            a.steps,
            0,
            dtype,
        )
        for mode, name in (
            ("relay", "relay"),
            ("whole-relay", "whole, then relay"),
            ("whole", "whole"),
        ):
            out = work / f"{tag}-{mode}.json"
            doc = _run(ckpt, out, mode, train, work, a.steps, limit, dtype)
            if "trained" in doc:
                doc["identical"] = doc["losses"] == ref["losses"] and all(
                    torch.equal(doc["trained"][k], ref["trained"][k]) for k in ref["trained"]
                )
            doc.pop("trained", None)
            rows.append(
                {"train": train, "dtype": dtype or "as stored", "run": f"{name} (limit)", **doc}
            )
        ref.pop("trained")
        rows.append(
            {"train": train, "dtype": dtype or "as stored", "run": "whole (no limit)", **ref}
        )
        print(json.dumps(rows[-4:], indent=1), flush=True)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "limit_bytes": limit,
        "frozen_bytes": frozen,
        "config": vars(a),
        "rows": rows,
    }
    for f in work.rglob("*"):
        if f.is_file():
            f.unlink()
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(result, indent=1))
        Path(a.out + ".md").write_text(_page(result))
    print(_page(result))


def _page(r: dict) -> str:
    def mib(n: float) -> str:
        return f"{n / MIB:.0f}"

    lines = [
        f"frozen weights {mib(r['frozen_bytes'])} MiB; limit {mib(r['limit_bytes'])} MiB "
        f"({r['frozen_bytes'] / r['limit_bytes']:.2f} x); {r['machine']}, torch {r['torch']}",
        "",
        "| fine-tune | dtype | run | load peak MiB | steps peak MiB | step s (median) | read MiB / step | bit-identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        if "exit" in row:
            lines.append(
                f"| {row['train']} | {row['dtype']} | {row['run']} | exit {row['exit']} "
                f"({'OOM-killed' if row['oom_killed'] else 'failed'}) | | | | |"
            )
            continue
        steps = sorted(row["step_s"])
        read = row["read_bytes_per_step"]
        lines.append(
            f"| {row['train']} | {row['dtype']} | {row['run']} | {mib(row['load_peak'])} | "
            f"{mib(row['steps_peak'])} | {steps[len(steps) // 2]:.2f} | "
            f"{mib(sum(read) / len(read)) if read else '-'} | {row.get('identical', 'reference')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
