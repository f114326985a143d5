"""The memory wall on a GPU: ``offloadd wall`` on a Llama-style HF config in bf16, and its page.

Writes a Llama-style ``config.json`` (by default hidden 2048, 16 layers, 16 heads, MLP 5632,
vocabulary 32000: about 1.1 B parameters; attention through SDPA, transformers' default), runs
``offloadd wall`` on it at ``--seq`` with the device memory limited to ``--memory-limit``, and
writes ``OUT/wall.md``: each strategy's largest batch, its throughput and peak there, auto
against the fastest other strategy at each batch both train, the command and the machine. The
strategies are offloadd's (plain, recompute, offload-cpu, auto) and the peers
(``--strategies peers``: sac, compile-budget, and on a GPU compile-offload and
torchtune-offload where torchtune installs). Each point is a fresh process that builds the
model, so a part takes minutes: scripts/gpu_check.sh runs ``wall`` and ``wall-peers`` as two
parts, one device call each.

``--tiny`` runs the same on the CPU at toy size, inside a memory cgroup (root): the path the
tests take, so that the kit does not rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

OURS = "plain,recompute,offload-cpu,auto"
PEERS = "sac,compile-budget,compile-offload,torchtune-offload"

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
TINY = LLAMA | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (wall.csv, wall.md, ...)")
    p.add_argument(
        "--strategies", default=OURS, help=f"'ours' ({OURS}), 'peers' ({PEERS}), or a list"
    )
    p.add_argument("--memory-limit", default="40GiB", help="device memory (default 40GiB)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--most", type=int, default=None, help="largest batch tried (64; --tiny: 8)")
    p.add_argument("--point-timeout", type=float, default=120.0, help="seconds a point may take")
    p.add_argument("--tiny", action="store_true", help="toy size on the CPU (the tests' path)")
    p.add_argument("--python", default=sys.executable, help="the interpreter offloadd runs in")
    return p.parse_args(argv)


def strategies(named: str, tiny: bool) -> str:
    names = {"ours": OURS, "peers": PEERS}.get(named, named).split(",")
    if tiny:  # on the CPU: the host tier, and no GPU-only peer
        gpu_only = ("compile-offload", "torchtune-offload")
        names = [n.replace("offload-cpu", "offload-ssd") for n in names if n not in gpu_only]
    elif "torchtune-offload" in names:
        import importlib.util

        if importlib.util.find_spec("torchtune") is None:
            print("wall_gpu: torchtune is not installed here: torchtune-offload left out")
            names.remove("torchtune-offload")
    return ",".join(names)


def command(a: argparse.Namespace, config_dir: Path, out: Path) -> list[str]:
    cmd = [a.python, "-m", "offloadd", "wall", "--hf-config", str(config_dir)]
    cmd += ["--strategies", strategies(a.strategies, a.tiny), "--out", str(out), "--no-plot"]
    cmd += ["--no-predict"] if a.tiny else []  # the CPU path checks the kit, not predictions
    cmd += ["--steps", "2", "--warmup", "1", "--point-timeout", str(a.point_timeout)]
    if a.tiny:
        return [*cmd, "--seq", "64", "--memory-limit", "1GiB", "--most", str(a.most or 8)]
    return [
        *cmd,
        "--seq",
        str(a.seq),
        "--memory-limit",
        a.memory_limit,
        "--most",
        str(a.most or 64),
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--start",
        "2",
    ]


def page(out: Path, cmd: list[str], log: str) -> str:
    """wall.md: the table of walls, what the wall printed under it, the command."""
    doc = json.loads((out / "wall.json").read_text())
    with (out / "wall.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    head = log.splitlines()[0] if log else ""  # "offloadd wall: <title>; ...; <machine>"
    lines = [f"# The memory wall: {doc['title']}", "", head.removeprefix("offloadd wall: "), ""]
    lines += ["| strategy | largest batch | samples/s there | peak there | stopped by |"]
    lines += ["|---|---|---|---|---|"]
    for s, w in doc["walls"].items():
        at: dict[str, Any] = next(
            (
                r
                for r in rows
                if r["strategy"] == s
                and r["status"] == "ok"
                and int(r["batch_size"]) == w["largest"]
            ),
            {},
        )
        thr = f"{float(at['samples_per_s']):.2f}" if at else "-"
        peak = f"{int(at['peak_bytes']) / 2**30:.2f} GiB" if at.get("peak_bytes") else "-"
        stop = f"{w['failed_as']} at {w['smallest_failed']}" if w["smallest_failed"] else "-"
        lines.append(f"| {s} | {w['largest']} | {thr} | {peak} | {stop} |")
    tail = log.split("\n\n")[-2] if "\n\n" in log else log  # the summary offloadd wall printed
    lines += ["", "```text", tail.strip("\n"), "```", "", "Command:", "", "```sh", " ".join(cmd)]
    lines += ["```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(a.out)
    config_dir = out / "config"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(TINY if a.tiny else LLAMA, indent=1))
    cmd = command(a, config_dir, out / "wall")
    print("wall_gpu:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (out / "wall.log").write_text(proc.stdout + proc.stderr)
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    if not (out / "wall" / "wall.json").exists():
        return proc.returncode or 1
    (out / "wall.md").write_text(page(out / "wall", cmd, proc.stdout))
    print(f"wall_gpu: wrote {out / 'wall.md'}")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
