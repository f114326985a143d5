"""Offloading switched on by the environment, for training scripts that never import offloadd.

``offloadd_boot`` (run from ``offloadd.pth`` at start-up) calls :func:`activate` right after the
program imported torch. Activation reads and validates the environment at once, so a typo fails
the ``import torch`` with an error naming the variable, long before the first forward. It then
installs the :mod:`offloadd.integrations.scope` hooks. The :class:`~offloadd.Offloader` itself is created
at the first training forward, so processes that import torch but never train (launchers,
data-loader workers, tools) open no files and print nothing.

Variables: ``OFFLOADD`` (1/true/yes/on, or 0/false/no/off), ``OFFLOADD_CONFIG`` (a TOML file),
``OFFLOADD_<FIELD>`` (any :class:`~offloadd.Config` field; ``OFFLOADD_CODEC_<FIELD>`` for its
``codec`` section, ``OFFLOADD_DAEMON_<FIELD>`` for its ``daemon`` section, of which the training
side reads ``socket``), ``OFFLOADD_REPORT`` (a JSON
path written at exit, ``{rank}`` substituted) and ``OFFLOADD_LOG`` (the level of offloadd's
log on stderr: debug, info, warning, error).

Note: [per-rank namespace] In a multi-rank job each rank offloads into ``<dir>/rank-<N>`` of
every ``ssd_dirs`` entry (created with mode 0700, removed at exit when empty), so ranks that
share a node and a directory never share a directory entry, and what is on disk can be told
apart per rank. The rank is the one known at the first training forward, not at activation
(offloadd/integrations/ranks.py [the rank when it is known]). A daemon session, when that
backend exists, is named after ``RANK`` the same way.

Note: [fork] A child made with ``os.fork`` (data-loader workers on Linux) inherits the hooks;
they are switched off in the child, and the child writes no summary and no report.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from offloadd.auto.plan_report import plan_dict
from offloadd.config import Config
from offloadd.integrations.ranks import group_rank, rank_now
from offloadd.integrations.report import report_dict, summary_line, write_report
from offloadd.integrations.scope import ModuleScope
from offloadd.integrations.settings import EnvSettings
from offloadd.memsave import memsave
from offloadd.offloader import Offloader
from offloadd.relay import relay
from offloadd.relay.state import is_relayed
from offloadd.relay.surface import RelayStats, forward_begun, keep_final_stats

__all__ = ["AutoOffload", "EnvSettings", "activate", "current"]

log = logging.getLogger("offloadd")


class AutoOffload:
    """One process's environment-activated offloading: scope hooks, a lazy Offloader, exit."""

    def __init__(self, settings: EnvSettings) -> None:
        self.settings = settings
        self.ranks = settings.ranks  # taken again at the first forward and at exit
        self.offloader: Offloader | None = None
        self.ssd_dirs: tuple[str, ...] = ()
        self._created_dirs: list[str] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._started = time.monotonic()
        self._finished = False
        self._memsaved: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._relayed: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # what relay moved for the exit report: the stats of the models relayed here, appended
        # when each is dropped, or at exit by its finalizer (relayed still, or unrelayed since)
        self._relay_final: list[weakref.finalize[Any, Any]] = []
        self._relay_done: list[RelayStats] = []
        self.scope = ModuleScope(self._enter, self._leave)

    def install(self) -> None:
        if self.settings.log_level is not None:
            _configure_log(self.settings.log_level)
        self.scope.install()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.scope.enabled = False
        if self.offloader is not None:
            # The parent's I/O threads do not exist here: closing at exit would wait for them.
            self.offloader.detach()

    def _enter(self, module: nn.Module) -> bool:
        if self.settings.config.memsave and module not in self._memsaved:
            # Once per root module (config ``memsave``); its children's forwards, which run
            # after this, are the selective ones. The root's own class is swapped too if it is
            # a supported one, for its next forward.
            memsave(module)
            self._memsaved.add(module)
        off = self.offloader or self._create()
        if self.settings.config.relay == "frozen" and module not in self._relayed:
            # Once per root module (config ``relay``), before its hooks run for this call;
            # not a model the script relayed itself.
            self._relayed.add(module)
            if not is_relayed(module):
                dirs = self.ssd_dirs or self._rank_dirs(self.settings.config)
                self.ssd_dirs = dirs
                relay(module, config=replace(self.settings.config, tier="ssd", ssd_dirs=dirs))
                forward_begun(module)  # this call's module hooks were gathered without relay's
                self._relay_final.append(keep_final_stats(module, self._relay_done))
        off.__enter__()
        # The model of this scope: its parameters and buffers are never moved, and a budget
        # plans it (see [no module hook] in compiled.py).
        off.note_module(module)
        return True

    def _leave(self) -> None:
        assert self.offloader is not None
        self.offloader.__exit__(None, None, None)

    def _create(self) -> Offloader:
        with self._lock:
            if self.offloader is not None:
                return self.offloader
            cfg = self.settings.config
            self.ranks = rank_now()  # see [the rank when it is known] in ranks.py
            if cfg.tier != "keep":
                self.ssd_dirs = self._rank_dirs(cfg)
                cfg = replace(cfg, ssd_dirs=self.ssd_dirs)
            self.offloader = Offloader(cfg)
            log.info(
                "offloadd: active%s, tier %s, dirs %s",
                f" ({self.ranks.label()})" if self.ranks.multi else "",
                cfg.tier,
                ", ".join(self.ssd_dirs) or "-",
            )
            # atexit runs handlers last-in first-out, and weakref.finalize registered its own exit
            # handler no later than the Offloader's creation: this runs before the Offloader's
            # finalizer, while stats can still be read.
            atexit.register(self.finish)
            return self.offloader

    def _rank_dirs(self, cfg: Config) -> tuple[str, ...]:
        from offloadd.io.files import default_offload_dir

        dirs = list(cfg.ssd_dirs) or [default_offload_dir()]
        ranks = self.ranks
        if not ranks.multi:
            return tuple(dirs)
        out = []
        for d in dirs:
            sub = os.path.join(d, f"rank-{ranks.rank}")
            try:
                os.mkdir(sub, 0o700)
                self._created_dirs.append(sub)
            except FileExistsError:
                pass
            out.append(sub)
        return tuple(out)

    def finish(self) -> None:
        """Close the Offloader, print the summary line and write the report (once, at exit)."""
        if self._finished or os.getpid() != self._pid or self.offloader is None:
            return
        self._finished = True
        self.scope.enabled = False
        off = self.offloader
        try:
            self.ranks = group_rank() or self.ranks  # see [the rank when it is known]
            stats = off.stats()
            plan = off.plan()
            for fin in self._relay_final:
                fin()  # a model alive: its stats now (a dropped one's were appended then)
            relayed = tuple(self._relay_done)
            off.close()
            wall = time.monotonic() - self._started
            _say(summary_line(stats, self.ranks, self.scope.scopes, wall, relayed, plan))
            report = self.settings.report_path(self.ranks)
            if report is not None:
                data = report_dict(
                    stats=stats,
                    ranks=self.ranks,
                    config=off.config,
                    forwards=self.scope.scopes,
                    wall_s=wall,
                    plan=plan_dict(plan) if plan is not None else None,
                    relayed=relayed,
                )
                write_report(report, data)
        except Exception as e:  # never change how the program exits
            _say(f"offloadd: writing the exit summary failed: {e!r}")
        for d in reversed(self._created_dirs):
            with contextlib.suppress(OSError):  # not empty (in use by another process) or gone
                os.rmdir(d)


def _say(line: str) -> None:
    """``line`` on stderr in one write: the ranks of a node share one stderr, and print()'s
    separate newline let another rank's line in between (two summaries on one line)."""
    stream = sys.stderr
    if stream is None:  # closed (pythonw, a daemonized parent): nowhere to say it
        return
    stream.write(line + "\n")
    stream.flush()


_state: AutoOffload | None = None
_state_lock = threading.Lock()


def activate(environ: Mapping[str, str] | None = None) -> AutoOffload | None:
    """Validate the environment and install the hooks (once per process); None when disabled."""
    global _state
    with _state_lock:
        if _state is not None:
            return _state
        try:
            settings = EnvSettings.from_env(environ)
        except ValueError as e:
            raise ValueError(f"offloadd (activated by the environment): {e}") from None
        if not settings.enabled:
            return None
        _state = AutoOffload(settings)
        _state.install()
        return _state


def current() -> AutoOffload | None:
    """The active environment offloading of this process, if any."""
    return _state


def _configure_log(level: str) -> None:
    logger = logging.getLogger("offloadd")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)
