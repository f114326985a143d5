"""The daemon's configuration: a kw-only dataclass read from TOML (``configs/daemon.toml``).

Every field is a TOML key; the ``offloadd serve`` options override the file. Bad values raise
:class:`ValueError` naming the key and the value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from offloadd.config.schema import parse_size, read_toml

__all__ = ["Checksum", "DaemonConfig", "default_socket_path"]

Checksum = Literal["xxh3", "crc32", "none"]
DirectIO = Literal["auto", "on", "off"]


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/offloadd/daemon.sock``, else ``/tmp/offloadd-run-$UID/daemon.sock``."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(run, "offloadd") if run else f"/tmp/offloadd-run-{os.getuid()}"
    return os.path.join(base, "daemon.sock")


@dataclass(kw_only=True, slots=True, frozen=True)
class DaemonConfig:
    """How ``offloadd serve`` runs. Every field has a default that works."""

    socket: str = ""
    """Unix socket path; its directory is created 0700 and the socket 0600. Empty: the per-user
    default (``$XDG_RUNTIME_DIR/offloadd/daemon.sock`` or ``/tmp/offloadd-run-$UID/daemon.sock``)."""

    dirs: tuple[str, ...] = ()
    """Offload directories (one per drive), striped chunk by chunk. Empty: the per-user default
    directory of the embedded engine."""

    quota_bytes: int = 0
    """Disk bytes one session may hold at once; a write past it is refused and the client keeps
    that chunk in memory. 0: no quota."""

    checksum: Checksum = "xxh3"
    """Per-chunk checksum computed on write and verified on read: ``xxh3`` (the xxhash package, a
    dependency of offloadd), ``crc32`` (zlib; slower) or ``none``."""

    allowed_uids: tuple[int, ...] = ()
    """User ids besides the daemon's own that may connect (checked with SO_PEERCRED)."""

    io_threads: int = 4
    """Requests the I/O engine runs at once (shared by all sessions)."""

    direct_io: DirectIO = "auto"
    """O_DIRECT use for offload files, as the client's ``direct_io``."""

    max_sessions: int = 64
    """Sessions open at once; more are refused."""

    max_shm_bytes: int = 1 << 30
    """Largest shared memory (staging plus read slots) one session may ask for."""

    max_chunk_bytes: int = 64 << 20
    """Largest chunk (slot) size a session may ask for."""

    metrics_port: int = 0
    """Serve Prometheus metrics on 127.0.0.1:PORT (needs prometheus-client, the ``daemon``
    extra). 0: off."""

    def __post_init__(self) -> None:
        for key, choices in (("checksum", get_args(Checksum)), ("direct_io", get_args(DirectIO))):
            if getattr(self, key) not in choices:
                raise ValueError(
                    f"{key} must be one of {', '.join(choices)}; got {getattr(self, key)!r}"
                )
        if not isinstance(self.socket, str):
            raise ValueError(f"socket must be a path, got {self.socket!r}")
        object.__setattr__(self, "socket", os.path.expanduser(self.socket))
        dirs = self.dirs
        if isinstance(dirs, str) or not all(isinstance(d, str) and d.strip() for d in dirs):
            raise ValueError(f"dirs must be a list of directory paths, got {dirs!r}")
        object.__setattr__(self, "dirs", tuple(os.path.expanduser(d) for d in dirs))
        uids = self.allowed_uids
        if isinstance(uids, str) or not all(
            isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in uids
        ):
            raise ValueError(f"allowed_uids must be a list of user ids, got {uids!r}")
        object.__setattr__(self, "allowed_uids", tuple(uids))
        for key, low, high in (
            ("quota_bytes", 0, 1 << 62),
            ("io_threads", 1, 256),
            ("max_sessions", 1, 1 << 16),
            ("max_shm_bytes", 4096, 1 << 40),
            ("max_chunk_bytes", 4096, 1 << 30),
            ("metrics_port", 0, 65535),
        ):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
                raise ValueError(f"{key} must be an integer in {low}..{high}, got {v!r}")

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path()

    @classmethod
    def from_mapping(cls, values: dict[str, Any], *, source: str = "config") -> DaemonConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(names))}"
            )
        conv: dict[str, Any] = {}
        for k, v in values.items():
            if k in ("quota_bytes", "max_shm_bytes", "max_chunk_bytes"):
                v = parse_size(k, v)
            elif k in ("dirs", "allowed_uids"):
                if not isinstance(v, list | tuple):
                    raise ValueError(f"{source}: {k} must be a list, got {v!r}")
                v = tuple(v)
            conv[k] = v
        return cls(**conv)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> DaemonConfig:
        """Read a TOML file whose top-level keys (or ``[daemon]`` table) are field names."""
        return cls.from_mapping(read_toml(path, "daemon"), source=str(path))

    def replace(self, **changes: Any) -> DaemonConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return DaemonConfig(**values)
