"""The ``offloadd`` command."""

from __future__ import annotations

import argparse
import logging
import sys

from offloadd import __version__, demo

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="offloadd", description="Lossless activation offloading for PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"offloadd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser(
        "demo", help="train the built-in GPT with keep and with ssd offload, and compare"
    )
    demo.add_arguments(p_demo)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, stream=sys.stderr)
    if ns.command == "demo":
        return demo.main(ns)
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
