"""The daemon's settings: the ``daemon`` section of :class:`~offloadd.config.Config`.

In TOML they are the ``[daemon]`` table (``configs/daemon.toml`` documents every key); in the
environment ``OFFLOADD_DAEMON_<KEY>`` (``OFFLOADD_DAEMON_QUOTA_BYTES=64GiB``). ``offloadd serve``
reads the whole section, and its command-line options override it; the training side reads only
``socket`` and ``trusted_uids``. Errors name the dotted key (``daemon.quota_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from offloadd.config.fields import Settings, setting
from offloadd.config.validators import Choice, DirectIO, Dirs, Int, Size, SocketPath, Uids

__all__ = ["Checksum", "DaemonConfig"]

Checksum = Literal["xxh3", "crc32", "none"]


@dataclass(kw_only=True, slots=True, frozen=True)
class DaemonConfig(Settings):
    """How ``offloadd serve`` runs and where clients find it. Every field has a working default."""

    section: ClassVar[str] = "daemon"

    socket: str = setting("", SocketPath())
    """Unix socket path. The daemon listens on it (the socket 0600, 0666 with ``allowed_uids``;
    a missing directory is created 0700, 0711 with ``allowed_uids``, an existing one is used as
    it is, and one that is a symbolic link is refused); the training side, when it is set and
    the tier is ``ssd``, has the daemon there do its I/O: staging memory is shared with it, and
    ``ssd_dirs``/``engine``/``io_threads``/``direct_io`` are the daemon's business (an
    unreachable or untrusted daemon raises at the Offloader's construction; see
    ``trusted_uids``).
    ``"default"``: the per-user default path, ``$XDG_RUNTIME_DIR/offloadd/daemon.sock`` or
    ``/tmp/offloadd-run-$UID/daemon.sock`` (one rule for the daemon and every client:
    offloadd/wire/address.py [the default socket]). Empty: the daemon listens on the default,
    ``offloadd status`` and ``stop`` look there, and the training side uses its embedded
    engine."""

    dirs: tuple[str, ...] = setting((), Dirs())
    """Offload directories (one per drive), striped chunk by chunk. Empty: the per-user default
    directory of the embedded engine. (The training side's ``ssd_dirs`` do not apply here.)"""

    quota_bytes: int = setting(0, Size(0, 1 << 62))
    """Disk bytes per user: what all the sessions of one uid may hold at once, together (a
    client may open many sessions). A write past it is refused and the client keeps that chunk
    in memory. 0: no quota."""

    checksum: Checksum = setting("xxh3", Choice(get_args(Checksum)))
    """Per-chunk checksum computed on write and verified on read: ``xxh3`` (the xxhash package, a
    dependency of offloadd), ``crc32`` (zlib; slower) or ``none``."""

    allowed_uids: tuple[int, ...] = setting((), Uids())
    """User ids besides the daemon's own that may connect (checked with SO_PEERCRED). When set,
    the socket is 0666 and a socket directory the daemon creates is 0711 (an existing one keeps
    its mode, with a warning if others may not pass through it), and the SO_PEERCRED check alone
    keeps other users out (see offloadd/daemon/core.py [socket modes])."""

    trusted_uids: tuple[int, ...] = setting((), Uids())
    """The client's side (the training side, ``offloadd status`` and ``stop``): user ids besides
    its own and root whose daemon it talks to, for a daemon run by a service user. A client
    checks the uid of the process listening at ``socket`` and the owner of the socket's
    directory before it sends a byte, and refuses any other (see offloadd/wire/trust.py
    [who trusts whom]). The daemon does not read it."""

    io_threads: int = setting(4, Int(1, 256))
    """Requests the daemon's I/O engine runs at once (shared by all sessions). The daemon's own
    value: the training side's ``io_threads`` sizes only its embedded engine."""

    direct_io: DirectIO = setting("auto", Choice(get_args(DirectIO)))
    """O_DIRECT use for the daemon's offload files, with the same values as the training side's
    ``direct_io``, which applies only to the embedded engine's files."""

    max_sessions: int = setting(64, Int(1, 1 << 16))
    """Sessions one user (uid) may have open at once; more of that uid's are refused (EUSERS),
    and other users' sessions are not counted against it. With ``max_shm_bytes`` it bounds the
    shared memory the daemon creates for each uid it accepts (see offloadd/daemon/session.py
    [sessions per user])."""

    max_shm_bytes: int = setting(1 << 30, Size(4096, 1 << 40))
    """Largest shared memory (staging plus read slots) one session may ask for."""

    max_chunk_bytes: int = setting(64 << 20, Size(4096, 1 << 30))
    """Largest chunk (slot) size a session may ask for."""

    metrics_port: int = setting(0, Int(0, 65535))
    """Serve Prometheus metrics on 127.0.0.1:PORT (needs prometheus-client, the ``daemon``
    extra). Every local user can read them: daemon-wide figures and each session's bytes by
    session number, with no identity, pid or uid (see offloadd/daemon/metrics.py [what the
    metrics show]). 0: off."""
