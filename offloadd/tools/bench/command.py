"""``offloadd bench``: benchmarks that print the ratio they exist for (see docs/benchmarks/)."""

from __future__ import annotations

import argparse

from offloadd.tools.bench import hooks as bench_hooks
from offloadd.tools.bench import io as bench_io
from offloadd.tools.bench import memsave as bench_memsave
from offloadd.tools.bench import relay as bench_relay
from offloadd.tools.bench import step as bench_step

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    bench_io.add_arguments(sub.add_parser("io", help=bench_io.HELP, description=bench_io.__doc__))
    bench_step.add_arguments(
        sub.add_parser("step", help=bench_step.HELP, description=bench_step.__doc__)
    )
    bench_memsave.add_arguments(
        sub.add_parser("memsave", help=bench_memsave.HELP, description=bench_memsave.__doc__)
    )
    bench_relay.add_arguments(
        sub.add_parser("relay", help=bench_relay.HELP, description=bench_relay.__doc__)
    )
    bench_hooks.add_arguments(
        sub.add_parser("hooks", help=bench_hooks.HELP, description=bench_hooks.__doc__)
    )


def main(ns: argparse.Namespace) -> int:
    tools = {
        "hooks": bench_hooks,
        "step": bench_step,
        "memsave": bench_memsave,
        "relay": bench_relay,
    }
    status: int = tools.get(ns.bench, bench_io).main(ns)
    return status
