"""Frozen weights relayed from the store layer by layer (L2L): :func:`relay`.

A frozen-backbone or adapter fine-tune holds weights that never change; relay writes them once
to the ssd tier and reads each layer's back just before it runs, in forward and again in
backward, ``relay_window`` layers at a time (docs/relay.md). Losses and gradients are
bit-identical to the model without relay.
"""

from __future__ import annotations

from offloadd.relay.placeholder import RelayedWeight, RelayError
from offloadd.relay.surface import RelayStats, relay, relay_stats, resident, unrelay

__all__ = [
    "RelayError",
    "RelayStats",
    "RelayedWeight",
    "relay",
    "relay_stats",
    "resident",
    "unrelay",
]
