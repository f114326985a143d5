"""offloadd: lossless, asynchronous offloading of saved activations to SSD or host memory.

What users need: :class:`Offloader` (a context manager around forward), :class:`Config` and
:class:`Stats`; :func:`memsave` (modules that save for backward only what the gradients
read); :func:`host_cache` (offloadd's CPU allocator, for training without offloading too); :func:`relay`
(frozen weights read in layer by layer from ssd), with :func:`unrelay`, :func:`resident` and
:func:`relay_stats`. What
extension writers need: :class:`Backend` (where chunks go), :class:`Engine` with
:class:`Request` and :class:`Op` (how bytes move), :class:`Ordering` (how an asynchronous device
orders its copies). See docs/architecture.md.

Each name is imported on first use, so that ``import offloadd`` (and with it ``offloadd --help``
and ``offloadd --version``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offloadd.backend import Backend
    from offloadd.config import CodecConfig, Config, DaemonConfig
    from offloadd.io import Engine, Op, Request
    from offloadd.memsave import memsave
    from offloadd.offloader import Offloader
    from offloadd.relay import RelayError, RelayStats, relay, relay_stats, resident, unrelay
    from offloadd.runtime import Ordering, Stats
    from offloadd.runtime.host_allocator import host_cache

__all__ = [
    "Backend",
    "CodecConfig",
    "Config",
    "DaemonConfig",
    "Engine",
    "Offloader",
    "Op",
    "Ordering",
    "RelayError",
    "RelayStats",
    "Request",
    "Stats",
    "__version__",
    "host_cache",
    "memsave",
    "relay",
    "relay_stats",
    "resident",
    "unrelay",
]

__version__ = "0.1.0"

_HOMES = {
    "Backend": "offloadd.backend",
    "CodecConfig": "offloadd.config",
    "Config": "offloadd.config",
    "DaemonConfig": "offloadd.config",
    "Engine": "offloadd.io",
    "Offloader": "offloadd.offloader",
    "Op": "offloadd.io",
    "Ordering": "offloadd.runtime",
    "Request": "offloadd.io",
    "Stats": "offloadd.runtime",
    "host_cache": "offloadd.runtime.host_allocator",
    "memsave": "offloadd.memsave.replace",
    "RelayError": "offloadd.relay.placeholder",
    "RelayStats": "offloadd.relay.surface",
    "relay": "offloadd.relay.surface",
    "relay_stats": "offloadd.relay.surface",
    "resident": "offloadd.relay.model_ops",
    "unrelay": "offloadd.relay.surface",
}

# offloadd.memsave is a package and offloadd.memsave the function: the package is imported now
# (it is light) and its name dropped, so that importing it later (or any module of it) does not
# bind the package over the function, which __getattr__ returns.
for _light in ("memsave", "relay"):  # the packages, light; their names are the functions
    importlib.import_module(f"offloadd.{_light}")
    del globals()[_light]
del _light


def __getattr__(name: str) -> Any:
    """A public name, imported on first use; the first release's names, read until 0.3.0 (see
    [renamed keys] in config/renamed.py)."""
    home = _HOMES.get(name)
    if home is None:
        from offloadd.config import Config
        from offloadd.config.renamed import old_class_name

        return old_class_name(__name__, name, Config)
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
