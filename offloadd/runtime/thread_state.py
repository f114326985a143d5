"""One Offloader's per-thread state: :class:`ThreadState`."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["ThreadState"]


class ThreadState(threading.local):
    """The scopes open on this thread, and the marks a budget's planner sets for the block
    running on it (see :class:`~offloadd.runtime.stages.PlannerView`). Class defaults, so that
    the hooks' reads of an unset one raise no AttributeError inside getattr, whose cost would be
    paid per saved tensor."""

    stack: list[Any] | None = None
    tag: int | None = None  # auto: the block being run, while it is recorded
    keep: bool = False  # auto: the running block's decision is to keep
