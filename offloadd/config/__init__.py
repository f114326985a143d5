"""One configuration: :class:`Config` (the training side) with the daemon's settings as a section.

``schema`` (:class:`Config`), ``daemon`` (its ``daemon`` section, :class:`DaemonConfig`),
``loader`` (:meth:`Config.load`: TOML files from ``configs/``, then ``OFFLOADD_*`` environment
variables) and ``kinds`` (how each value is read and checked). Every error names the dotted key,
the value and where it came from.
"""

from offloadd.config.daemon import DaemonConfig, default_socket_path
from offloadd.config.kinds import parse_size
from offloadd.config.loader import DAEMON_ENV_PREFIX, ENV_PREFIX, RESERVED_ENV, env_var, load_daemon
from offloadd.config.renamed import old_class_name
from offloadd.config.schema import Config

__all__ = [
    "DAEMON_ENV_PREFIX",
    "ENV_PREFIX",
    "RESERVED_ENV",
    "Config",
    "DaemonConfig",
    "default_socket_path",
    "env_var",
    "load_daemon",
    "parse_size",
]


def __getattr__(name: str) -> object:
    """The first release's names, read until 0.3.0 (see [renamed keys] in config/renamed.py)."""
    return old_class_name(__name__, name)
