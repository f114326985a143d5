"""Which saved tensors a compiled forward emptied, kept for its own backward's pass (Note
[whose backward]; the ops and the pass that places them: graph_ops.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["Record", "emptied", "record", "recorded"]

# Note [whose backward]
# ~~~~~~~~~~~~~~~~~~~~~
# A backward's pass must know what its own forward's pass gave an evict: a saved tensor that
# was emptied and gets no fetch reaches its kernels as a 0-byte placeholder (a crash, or
# memory written that is not the tensor's). The forward is compiled first and the backward
# later, lazily, at its first call, under the forward's tracing context restored; but one
# context may compile several AOT graphs. DDP's optimizer splits one dynamo graph into one AOT
# graph per bucket, compiles every forward, then the backwards in reverse: a record kept on
# the context as "the last forward's" gave every backward the last bucket's (a crash, with a
# cold cache). So the record is kept on the context per AOT graph, under AOTAutograd's id of
# the graph, which its forward's and its backward's compiles both carry (``aot_graph_name``:
# "<id>_forward", "<id>_backward"; one id per graph in the process): exact whatever the order
# of the compiles and however many graphs share a context, and independent of torch's hand-off
# of each bucket's ``fw_metadata`` to its backward, which counts on the backwards being
# compiled one each, in exactly the reverse order of the forwards.
#
# The record names saved tensors by position, as the runtime passes them: the backward's
# inputs are the forward's saved tensors in the order the forward returns them (after any
# saved sizes, before the tangents); node names are labels that no rule ties together. It
# also holds each saved tensor's dtype and rank: a backward whose inputs differ (a torch that
# orders them otherwise) is treated as unrecorded.
#
# Unrecorded, every saved activation that is not a graph input is fetched: always exact
# (``fetch`` copies a tensor that has its bytes), at the cost of a copy of those not emptied.
# So it is when the forward came from inductor's FX graph cache, whose hit runs no pass (a
# graph identical to one compiled before in the process, as repeated blocks split by graph
# breaks are; every forward of a warm cache that AOTAutograd's own cache does not hold, and it
# holds none of DDP's graphs), and when no tracing context or no id is there. A pair from
# AOTAutograd's cache runs no pass at all, and was placed together. The record is part of the
# backward's cache key (``Placement.uuid``): backwards placed from different records, or
# without one, are cached apart.

Record = tuple[tuple[int, ...], tuple[str, ...]]  # positions emptied; each saved tensor's kind


def _graph_id() -> tuple[Any, str] | None:
    """The tracing context and AOTAutograd's id of the graph being compiled, or None."""
    ctx = torch._guards.TracingContext.try_get()
    name = getattr(ctx, "aot_graph_name", None)
    if ctx is None or not name:
        return None
    aot_id, sep, _ = str(name[0]).partition("_")
    return (ctx, aot_id) if sep and aot_id.isdigit() else None


def _kinds(saved: list[Any]) -> tuple[str, ...]:
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else n for n in saved]
    return tuple(
        f"{v.dtype}/{v.dim()}" if isinstance(v, Tensor) else type(v).__name__ for v in vals
    )


def record(positions: list[int], saved: list[Any]) -> None:
    """The forward's pass: it emptied ``saved[i]`` for each ``i`` in ``positions``."""
    at = _graph_id()
    if at is not None:
        records = at[0].__dict__.setdefault("_offloadd_evicted", {})
        records[at[1]] = (tuple(positions), _kinds(saved))


def recorded() -> Record | None:
    """What the forward of the graph being compiled emptied, if its pass ran here."""
    at = _graph_id()
    records = getattr(at[0], "_offloadd_evicted", None) if at is not None else None
    return records.get(at[1]) if isinstance(records, dict) and at is not None else None


def emptied(saved: list[Any]) -> frozenset[int] | None:
    """The backward's pass, ``saved`` its saved-tensor inputs in order: the positions its
    forward emptied, or None if unrecorded (or recorded for other inputs)."""
    found = recorded()
    if found is None or found[1] != _kinds(saved):
        return None
    return frozenset(found[0])
