"""offloadd: lossless, asynchronous offloading of saved activations to SSD or host memory.

What users need: :class:`Offloader` (a context manager around forward), :class:`Config` and
:class:`Stats`; :func:`memsave` (modules that save for backward only what the gradients
read); :func:`host_cache` (offloadd's CPU allocator, for training without offloading too). What extension writers need: :class:`Backend` (where chunks go),
:class:`Engine` with :class:`Request` and :class:`Op` (how bytes move), :class:`Ordering` (how
an asynchronous device orders its copies). See docs/architecture.md.
"""

from offloadd.backend import Backend
from offloadd.config import CodecConfig, Config, DaemonConfig
from offloadd.config.renamed import old_class_name
from offloadd.io import Engine, Op, Request
from offloadd.memsave import memsave
from offloadd.runtime import Offloader, Ordering, Stats
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
    "Request",
    "Stats",
    "__version__",
    "host_cache",
    "memsave",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """The first release's names, read until 0.3.0 (see [renamed keys] in config/renamed.py)."""
    return old_class_name(__name__, name, Config)
