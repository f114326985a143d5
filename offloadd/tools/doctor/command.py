"""``offloadd doctor``: whether offloadd, as configured, can work on this machine, and why not.

In the manner of DeepSpeed's ``ds_report`` and PyTorch's ``collect_env``: versions, each offload
directory (file system, an O_DIRECT write and read, free space, access), the io_uring probe,
kvikio/cuFile/GDS, the memory lock limit, huge pages and the host cache, the daemon's socket and
whether the client would trust what listens there, and what ``engine`` and ``host_allocator``
pick and why. Each finding is marked OK, INFO, WARN or FAIL; ``--json`` prints the same as one
JSON object. The exit status is 0 when the configured setup can work (warnings allowed), 1 when
it cannot, 2 for a bad option; the last line says which, and why.

The configuration is read as the training side reads it (``--config FILE``, else
``$OFFLOADD_CONFIG``, then the ``OFFLOADD_*`` variables); ``--ssd-dir`` and ``--socket`` replace
``ssd_dirs`` and ``daemon.socket``. Unlike other commands' directory options (Note [directories
of the command line] in cli_dirs.py), ``--ssd-dir`` is examined, never created: a missing
directory is a finding. Nothing is changed on the machine: no directory made, no library built,
no engine started; the probe files have no name and are gone when the check ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from offloadd import __version__
from offloadd.config import ENV_PREFIX, RESERVED_ENV, Config, parse_size
from offloadd.tools.doctor.checks import (
    Check,
    choice_checks,
    gds_checks,
    io_checks,
    memory_checks,
    version_checks,
)
from offloadd.tools.doctor.paths import daemon_checks, dir_checks, targets

__all__ = [
    "SECTIONS",
    "add_arguments",
    "diagnose",
    "format_report",
    "load_config",
    "main",
    "verdict_line",
]

SECTIONS: dict[str, str] = {
    "config": "Configuration",
    "versions": "Versions",
    "directories": "Offload directories",
    "io": "I/O engine",
    "gds": "GPUDirect Storage",
    "memory": "Memory",
    "daemon": "Daemon",
    "choices": "What the settings pick",
}
"""The JSON document's sections (always all present, in this order) and their titles."""

_MARK = {"ok": " OK ", "info": "INFO", "warn": "WARN", "fail": "FAIL"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", metavar="FILE", help="TOML config (default: $OFFLOADD_CONFIG); OFFLOADD_* apply"
    )
    p.add_argument(
        "--ssd-dir",
        action="append",
        dest="ssd_dirs",
        metavar="DIR",
        help="examine this offload directory instead of ssd_dirs (repeatable; never created)",
    )
    p.add_argument("--socket", help="examine this daemon socket as daemon.socket")
    p.add_argument(
        "--min-free",
        metavar="SIZE",
        help="FAIL a directory with less free space (default: staging_bytes; WARN below 10x)",
    )
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")


def load_config(
    path: str | None, ssd_dirs: list[str] | None = None, socket: str | None = None
) -> tuple[Config, Check]:
    """The configuration as the training side loads it, with the options' replacements, and the
    finding about it; a configuration that does not load is a FAIL, and the defaults are used."""
    file = path or os.environ.get("OFFLOADD_CONFIG") or None
    variables = sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and k not in RESERVED_ENV)
    changes: dict[str, Any] = {}
    if ssd_dirs:
        changes["ssd_dirs"] = tuple(ssd_dirs)
    if socket:
        changes["daemon"] = {"socket": socket}
    facts: dict[str, Any] = {"file": file, "variables": variables}
    try:
        cfg = Config.load(path)
        cfg = cfg.replace(**changes) if changes else cfg
        status, text = "ok", f"config file {file}" if file else "no config file"
    except ValueError as e:
        cfg = Config().replace(**changes) if changes else Config()
        status, text = "fail", f"the configuration does not load: {e}; the rest shows the defaults"
    text += f"; variables: {', '.join(variables) or 'none'}; tier {cfg.tier}"
    facts.update(
        {
            k: getattr(cfg, k)
            for k in ("tier", "ssd_dirs", "engine", "io_uring", "direct_io", "host_allocator")
        },
        staging_bytes=cfg.staging_bytes,
        daemon={k: getattr(cfg.daemon, k) for k in ("socket", "dirs", "direct_io", "trusted_uids")},
    )
    return cfg, Check("config", "ok" if status == "ok" else "fail", text, facts)


def diagnose(cfg: Config, min_free: int, config: Check | None = None) -> dict[str, Any]:
    """Every check for ``cfg``, and the verdict: the JSON document of ``offloadd doctor``."""
    daemon_does_io = bool(cfg.daemon.socket) and cfg.tier == "ssd"
    found: dict[str, list[Check]] = {name: [] for name in SECTIONS}
    found["config"] = [config or Check("config", "ok", "given by the caller")]
    found["versions"] = version_checks()
    dirs, problems = targets(cfg, daemon_does_io)
    found["directories"] = problems + [c for t in dirs for c in dir_checks(t, min_free)]
    found["io"] = io_checks(cfg)
    found["gds"] = gds_checks(cfg)
    found["memory"] = memory_checks(cfg)
    found["daemon"] = daemon_checks(cfg, min_free)
    host_cache = next(c for c in found["memory"] if c.id == "host_cache")
    found["choices"] = choice_checks(cfg, host_cache, daemon_does_io)
    every = [c for checks in found.values() for c in checks]
    fails = [c for c in every if c.status == "fail"]
    warnings = [c for c in every if c.status == "warn"]
    if fails:
        status, reason = "fail", _reason(fails[0])
        if len(fails) > 1:
            reason += f" (and {len(fails) - 1} more FAIL above)"
    elif warnings:
        n = len(warnings)
        status, reason = "warn", f"{n} warning{'s' if n > 1 else ''} (WARN above)"
    else:
        status, reason = "ok", "nothing to report"
    return {
        "offloadd": __version__,
        "status": status,
        "reason": reason,
        "exit_status": 1 if fails else 0,
        "min_free_bytes": min_free,
        "sections": {name: [c.as_dict() for c in checks] for name, checks in found.items()},
    }


def _reason(c: Check) -> str:
    """A finding's message, with what it is about where the message does not say it."""
    path = str(c.facts.get("path", ""))
    if c.subject and c.subject != "daemon" and not (path and path in c.message):
        return f"{c.subject}: {c.message}"
    return c.message


def verdict_line(doc: dict[str, Any]) -> str:
    """The report's last line: OK, OK with warnings, or FAIL and the first failure."""
    if doc["status"] == "fail":
        return f"offloadd doctor: FAIL: {doc['reason']}"
    if doc["status"] == "warn":
        return f"offloadd doctor: OK, with {doc['reason']}"
    return "offloadd doctor: OK"


def format_report(doc: dict[str, Any]) -> str:
    """The human-readable report of a :func:`diagnose` document, its verdict last."""
    lines = [f"offloadd doctor (offloadd {doc['offloadd']})"]
    for name, title in SECTIONS.items():
        lines += ["", title]
        subject = ""
        for c in doc["sections"].get(name, []):
            indent = "  "
            if c["subject"] and c["subject"] != "daemon":
                if c["subject"] != subject:
                    lines.append(f"  {c['subject']}")
                subject, indent = c["subject"], "    "
            lines.append(f"{indent}[{_MARK[c['status']]}] {c['message']}")
    lines += ["", verdict_line(doc)]
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    cfg, config = load_config(ns.config, ns.ssd_dirs, ns.socket)
    try:
        min_free = (
            cfg.staging_bytes if ns.min_free is None else parse_size("--min-free", ns.min_free)
        )
    except ValueError as e:
        print(f"offloadd doctor: {e}", file=sys.stderr)
        return 2
    doc = diagnose(cfg, min_free, config)
    if ns.json:
        print(json.dumps(doc, indent=2))
        print(verdict_line(doc), file=sys.stderr)
    else:
        print(format_report(doc))
    status: int = doc["exit_status"]
    return status
