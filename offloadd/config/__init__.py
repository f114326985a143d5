"""One configuration: :class:`Config` (the training side) with its sections, the daemon's
settings and the codec's.

``schema`` (:class:`Config`), ``daemon`` and ``codec`` (its sections, :class:`DaemonConfig` and
:class:`CodecConfig`), ``fields`` (a key declared once: its default and kind in one dataclass
field), ``validators`` (how each value is read and checked), ``loader`` (:meth:`Config.load`:
TOML files from ``configs/``, then ``OFFLOADD_*`` environment variables) and ``renamed`` (old
names, read with a warning). Every error names the dotted key, the value and where it came from.
"""

from offloadd.config.codec import CodecConfig
from offloadd.config.daemon import DaemonConfig
from offloadd.config.loader import ENV_PREFIX, RESERVED_ENV, env_var
from offloadd.config.renamed import old_class_name
from offloadd.config.schema import Config, load_daemon
from offloadd.config.validators import parse_size

DAEMON_ENV_PREFIX = f"{env_var(DaemonConfig.section)}_"
"""``OFFLOADD_DAEMON_``: the prefix of the daemon's section's variables."""

__all__ = [
    "DAEMON_ENV_PREFIX",
    "ENV_PREFIX",
    "RESERVED_ENV",
    "CodecConfig",
    "Config",
    "DaemonConfig",
    "env_var",
    "load_daemon",
    "parse_size",
]


def __getattr__(name: str) -> object:
    """The first release's names, read until 0.3.0 (see [renamed keys] in config/renamed.py)."""
    return old_class_name(__name__, name, Config)
