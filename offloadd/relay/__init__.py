"""Frozen weights relayed from the store layer by layer (L2L): :func:`relay`.

A frozen-backbone or adapter fine-tune holds weights that never change; relay writes them once
to the ssd tier and reads each layer's back just before it runs, in forward and again in
backward, ``relay_window`` layers at a time (docs/relay.md). Losses and gradients are
bit-identical to the model without relay.

| module | role |
|---|---|
| ``placeholder`` | ``RelayedWeight``, what a module holds in a relayed weight's place; ``RelayError`` |
| ``groups`` | what is read in at once (a layer), the slab layout, tied weights kept resident |
| ``slabs`` | page-aligned memory the weights come back into, given back when its last user dies |
| ``store`` | the records of weights over the runtime's ``Backend`` (embedded engine or daemon) |
| ``checkpoint`` | a safetensors checkpoint read tensor by tensor, its headers checked first |
| ``loading`` | a model built on the meta device matched to a checkpoint and filled group by group |
| ``pretrained`` | ``from_pretrained``: a transformers model built on the meta device and relayed from its directory |
| ``relayer`` | the forward and backward schedule: swaps, prefetch, saved views as refs, weights read on demand |
| ``release`` | a group whose weights come to require grad, made resident for good |
| ``state`` | a relayed model's state, kept on the model |
| ``model_ops`` | ``state_dict()``, ``load_state_dict()``, :func:`resident`, ``.to()`` on a relayed model |
| ``surface`` | :func:`relay`, :func:`unrelay`, :func:`relay_stats`; the hooks that run it |

The package itself is light (``import offloadd`` imports it): its names are imported on first
use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offloadd.relay.checkpoint import CheckpointError
    from offloadd.relay.loading import weights_on_meta
    from offloadd.relay.model_ops import resident
    from offloadd.relay.placeholder import RelayedWeight, RelayError
    from offloadd.relay.pretrained import from_pretrained
    from offloadd.relay.surface import RelayStats, relay, relay_stats, unrelay

__all__ = [
    "CheckpointError",
    "RelayError",
    "RelayStats",
    "RelayedWeight",
    "from_pretrained",
    "relay",
    "relay_stats",
    "resident",
    "unrelay",
    "weights_on_meta",
]

_HOMES = {
    "CheckpointError": "checkpoint",
    "RelayError": "placeholder",
    "RelayedWeight": "placeholder",
    "from_pretrained": "pretrained",
    "resident": "model_ops",
    "weights_on_meta": "loading",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    home = _HOMES.get(name, "surface")
    value = getattr(importlib.import_module(f"offloadd.relay.{home}"), name)
    globals()[name] = value
    return value
