"""Whose saved-tensor hooks are innermost on this thread: offloadd's, or someone else's.

Note: [innermost hooks] Autograd calls only the innermost pair of saved-tensor hooks. Hooks
pushed inside an Offloader's scope (non-reentrant or selective checkpointing, transformers'
gradient checkpointing, a user's own pair) take every save made under them, and offloadd never
sees those. Whoever decides something per saved tensor in offloadd's name (the budget planner's
recomputation) asks :func:`saves_reach_offloadd` first: a decision there would not apply, and a
block the planner checkpoints inside the user's checkpoint is run differently when the user's
checkpoint recomputes it in backward (where the planner never recomputes), which torch rejects.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PASSES_TO", "PassPack", "PassUnpack", "saves_reach_offloadd"]

PASSES_TO = "_offloadd_passes_to"
"""The attribute that marks offloadd's pack hooks: ``True`` on an Offloader's; on relay's, the
pack it passes every tensor other than a weight to (None: plain autograd)."""


def _passing() -> tuple[Any, Any]:
    """A pair that passes saved tensors on to the hooks below it in C, handing the others to
    Python (relay's: csrc/hot_path/passing.c), or None, None where offloadd.runtime._held is
    not built, or was built before it (docs/native.md)."""
    try:
        from offloadd.runtime._held import PassPack, PassUnpack
    except ImportError:
        return None, None
    return PassPack, PassUnpack


PassPack, PassUnpack = _passing()


def saves_reach_offloadd() -> bool:
    """Whether what autograd saves on this thread now reaches an Offloader's pack: the
    innermost hooks are an Offloader's, or relay's passing on to one (see [innermost hooks])."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    pack: Any = top[0] if top is not None else None
    while pack is not None:
        mark = getattr(pack, PASSES_TO, None)
        if mark is True:
            return True
        pack = mark
    return False
