"""offloadd in the user's profiler: ``torch.profiler`` ranges named ``offloadd::...``.

:func:`span` is a ``record_function`` range while a profiler runs (``torch.profiler.profile``,
``torch.autograd.profiler.profile``; under ``torch.autograd.profiler.emit_nvtx()`` torch makes
each an NVTX range, for Nsight Systems), and a shared no-op context otherwise: one C call to
ask, a small fraction of what the paths it is on already cost (a tensor that moves, a wait,
a read, a relayed group; docs/benchmarks/hooks_cpu-2core_2026-12-05.md). The ranges
(docs/troubleshooting.md shows how to read them):

==========================  ==========================================================
``offloadd::pack``          pack of a tensor that may move (its block, dedup, the plan)
``offloadd::capture``       its bytes taken: the copy into staging, the writes submitted
``offloadd::unpack``        unpack of an offloaded tensor, wait included
``offloadd::read_wait``     backward waiting for a read-back
``offloadd::read``          a read submitted (on demand or read ahead)
``offloadd::slot_wait``     forward waiting for a staging slot (writes behind)
``offloadd::relay_fetch``   relay: a group's weights read or waited for
``offloadd::relay_swap``    relay: a group swapped in (and others out)
``offloadd::daemon_send``   the daemon client sending requests (its sender thread)
``offloadd::daemon_reply``  the daemon client handling a reply (its receiver thread)
==========================  ==========================================================
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["span"]

_NONE = contextlib.nullcontext()
try:
    _enabled: Any = torch._C._autograd._profiler_enabled
except AttributeError:  # a torch without the probe: no ranges
    _enabled = None


def span(name: str) -> AbstractContextManager[Any]:
    """A profiler range called ``name`` while a profiler runs, else a no-op context."""
    if _enabled is not None and _enabled():
        return torch.profiler.record_function(name)
    return _NONE
