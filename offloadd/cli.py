"""The ``offloadd`` command.

Each subcommand lives in its own module, which provides ``add_arguments`` (fills its argparse
parser) and ``main`` (takes the parsed namespace, returns the exit status). Adding a subcommand is
one entry in ``_COMMANDS`` and its one-line help in ``_HELP``: the help lines stay here so that
``offloadd --help`` imports none of those modules. With the package root importing its names on
first use, ``offloadd --help`` and ``offloadd --version`` import no torch
(tests/test_layout.py times them).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from offloadd import __version__

__all__ = ["main"]

# name -> module, imported only when its command runs (or its own --help is asked for)
_COMMANDS: dict[str, str] = {
    "demo": "offloadd.tools.demo",
    "bench": "offloadd.tools.bench.command",
    "run": "offloadd.integrations.launch",
    "serve": "offloadd.daemon.cmd_serve",
    "status": "offloadd.backend.cmd_status",
    "stop": "offloadd.backend.cmd_stop",
    "rok": "offloadd.tools.rok.command",
    "plan": "offloadd.tools.plan",
    "wall": "offloadd.tools.wall.command",
    "doctor": "offloadd.tools.doctor.command",
}

_HELP: dict[str, str] = {
    "demo": "train the built-in GPT with keep, recompute and ssd offload, and compare",
    "bench": "benchmarks: `io` (the I/O engines against fio), `step` (keep, recompute, ssd), "
    "`memsave` (saved bytes with frozen layers)",
    "run": "run a command (training script, torchrun, deepspeed) with offloading switched on",
    "serve": "run the offload daemon in the foreground (one per node, shared by every rank)",
    "status": "show a running daemon's sessions, bytes held, throughput, queues and disk space",
    "stop": "stop a running daemon cleanly",
    "rok": "measure and plot recompute-offload-keep curves (memory vs throughput)",
    "plan": "print the keep / offload / recompute plan a memory budget gives a model",
    "wall": "find the largest batch or sequence each strategy trains inside a hard memory limit",
    "doctor": "check that offloadd, as configured, can work here (directories, O_DIRECT, "
    "io_uring, GDS, memory, daemon) and say why not",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="offloadd", description="Lossless activation offloading for PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"offloadd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    args = sys.argv[1:] if argv is None else argv
    # Only the chosen command's module is imported; the others only contribute their help line.
    chosen = next((a for a in args if not a.startswith("-")), None)
    modules = {}
    for name, modname in _COMMANDS.items():
        p = sub.add_parser(name, help=_HELP[name], description=_HELP[name])
        if name == chosen:
            modules[name] = importlib.import_module(modname)
            modules[name].add_arguments(p)
    ns = parser.parse_args(args)
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING,
        stream=sys.stderr,
        format="offloadd %(levelname)s %(name)s: %(message)s",
    )
    status: int = modules[ns.command].main(ns)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
