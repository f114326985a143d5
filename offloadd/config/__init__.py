"""One configuration: :class:`Config` (the training side) with the daemon's settings as a section.

Read from TOML (``configs/``), overridden by ``OFFLOADD_*`` environment variables; every error
names the key, the value and where it came from.
"""

from offloadd.config.daemon import DaemonConfig, default_socket_path
from offloadd.config.schema import ENV_PREFIX, RESERVED_ENV, Config, parse_size, read_toml

__all__ = [
    "ENV_PREFIX",
    "RESERVED_ENV",
    "Config",
    "DaemonConfig",
    "default_socket_path",
    "parse_size",
    "read_toml",
]
