"""A relayed model's state, kept on the model itself: :class:`RelayState`, :func:`state_of`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from offloadd.config import Config
from offloadd.relay.placeholder import RelayError
from offloadd.relay.relayer import Relay

__all__ = ["ATTR", "RelayState", "is_relayed", "state_of"]

ATTR = "_offloadd_relay"  # the model holds its relay's state: dropped with it, never kept alive


@dataclass(eq=False)
class RelayState:
    relay: Relay
    window: int
    config: Config
    kept: list[str]
    handles: list[Any] = field(default_factory=list)
    patched: list[Any] = field(default_factory=list)  # weak references to patched modules
    loading: dict[int, Any] = field(default_factory=dict)  # group -> the module loading it
    sd_cache: dict[int, Any] = field(default_factory=dict)  # one state_dict() call's slabs
    sd_values: dict[int, Any] = field(default_factory=dict)  # and values, a weight's once
    sd_open: bool = False  # a state_dict() of the model is under way
    converting: bool = False
    compile_warned: bool = False  # see [relay under torch.compile] in surface.py
    model_pre: Any = None  # relay's forward pre-hook on the model (see ``forward_begun``)
    handed: dict[int, list[Any]] = field(default_factory=dict)  # see [handed-out values]
    finalizer: Any = None


def is_relayed(model: nn.Module) -> bool:
    return ATTR in model.__dict__


def state_of(model: nn.Module) -> RelayState:
    state: RelayState | None = model.__dict__.get(ATTR)
    if state is None:
        raise RelayError("offloadd relay: this model is not relayed (call offloadd.relay(model))")
    return state
