"""What offloadd reads from the environment: :class:`EnvSettings`, validated, without torch.

``offloadd run`` checks the command's environment with it before it becomes the command, so a
typo fails at once, and the launcher (which then execs a training script that imports torch
itself) never pays for importing torch. :mod:`offloadd.integrations.autoload` reads the same
settings at activation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from offloadd.config import Config
from offloadd.integrations.ranks import RankInfo, rank_info

__all__ = ["EnvSettings"]

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
_LEVELS = ("debug", "info", "warning", "error")


@dataclass(kw_only=True, frozen=True, slots=True)
class EnvSettings:
    """Everything activation reads from the environment, validated."""

    enabled: bool
    config: Config
    ranks: RankInfo
    """The launcher variables' rank at activation: validated here, but a process may learn its
    rank later (see [the rank when it is known] in ranks.py)."""
    report: str | None = None
    """``OFFLOADD_REPORT`` with ``{rank}`` substituted by ``ranks``' rank (None: no report)."""
    report_template: str | None = None
    """``OFFLOADD_REPORT`` as given: :meth:`report_path` substitutes the rank known at exit."""
    report_every_rank: bool = False
    """The path held ``{rank}``: every rank writes its own report (else only rank 0 writes)."""
    log_level: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EnvSettings:
        """Read and check the environment; every error names the variable and its value."""
        env = os.environ if environ is None else environ
        flag = env.get("OFFLOADD")
        if flag is None:
            enabled = bool(env.get("OFFLOADD_CONFIG"))
        elif flag.strip().lower() in _ON:
            enabled = True
        elif flag.strip().lower() in (*_OFF, ""):
            enabled = False
        else:
            raise ValueError(
                f"OFFLOADD must be one of 1, true, yes, on, 0, false, no, off; got {flag!r}"
            )
        config = Config.from_env(env)
        for d in config.ssd_dirs:
            _check_dir(d)
        ranks = rank_info(env)
        template = report = env.get("OFFLOADD_REPORT") or None
        every_rank = report is not None and "{rank}" in report
        if report is not None:
            report = report.replace("{rank}", str(ranks.rank))
            parent = Path(report).expanduser().parent
            if not parent.is_dir():
                raise ValueError(
                    f"OFFLOADD_REPORT={env['OFFLOADD_REPORT']!r}: directory {str(parent)!r} "
                    "does not exist"
                )
        level = env.get("OFFLOADD_LOG") or None
        if level is not None and level.strip().lower() not in _LEVELS:
            raise ValueError(f"OFFLOADD_LOG must be one of {', '.join(_LEVELS)}; got {level!r}")
        return cls(
            enabled=enabled,
            config=config,
            ranks=ranks,
            report=report,
            report_template=template,
            report_every_rank=every_rank,
            log_level=level.strip().lower() if level else None,
        )

    def report_path(self, ranks: RankInfo) -> str | None:
        """Where the report of the process whose rank is ``ranks`` goes: None for none (no
        ``OFFLOADD_REPORT``, or a path without ``{rank}`` in a rank other than 0)."""
        if self.report_template is None or not (self.report_every_rank or ranks.rank == 0):
            return None
        return self.report_template.replace("{rank}", str(ranks.rank))


def _check_dir(d: str) -> None:
    p = Path(d)
    if not p.is_dir():
        raise ValueError(f"OFFLOADD_SSD_DIRS: directory {d!r} does not exist")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"OFFLOADD_SSD_DIRS: directory {d!r} is not writable")
