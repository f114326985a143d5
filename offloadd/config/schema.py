"""One configuration story: a kw-only dataclass, TOML files and ``OFFLOADD_*`` overrides.

Every field name is at once the TOML key (``configs/*.toml``) and, upper-cased behind the
``OFFLOADD_`` prefix, the environment variable (``min_bytes`` -> ``OFFLOADD_MIN_BYTES``).
Sizes accept plain integers or a binary/decimal suffix (``4MiB``, ``256k``, ``1G``).
Every bad value raises :class:`ValueError` naming the key and the value.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

__all__ = ["ENV_PREFIX", "RESERVED_ENV", "Config", "parse_size"]

ENV_PREFIX = "OFFLOADD_"
#: ``OFFLOADD_*`` variables that are not config fields but are read by other parts of offloadd.
RESERVED_ENV = frozenset({"OFFLOADD", "OFFLOADD_CONFIG", "OFFLOADD_REPORT", "OFFLOADD_LOG"})

Tier = Literal["keep", "cpu", "ssd"]
DirectIO = Literal["auto", "on", "off"]
EngineName = Literal["auto", "native", "python", "kvikio"]
IoUring = Literal["auto", "on", "off"]

_ALIGN = 4096
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(key: str, value: object) -> int:
    """Parse ``value`` (int or string like ``'4MiB'``) as a byte count; errors name ``key``."""
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a byte count, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            num, unit, suffix = int(m.group(1)), m.group(2).lower(), m.group(3).lower()
            base = 1000 if (unit and suffix == "b") else 1024
            return num * base ** _UNITS[unit]
    raise ValueError(f"{key} must be a byte count such as 1048576 or '1MiB', got {value!r}")


def _parse_bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
    raise ValueError(f"{key} must be a boolean (true/false/1/0), got {value!r}")


def _parse_int(key: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"{key} must be an integer, got {value!r}")


def _parse_dirs(key: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        parts = [p for p in re.split(r"[,:]", value) if p.strip()]
    elif isinstance(value, list | tuple):
        parts = list(value)
    else:
        raise ValueError(f"{key} must be a list of directories, got {value!r}")
    out = []
    for p in parts:
        if not isinstance(p, str | os.PathLike) or not str(p).strip():
            raise ValueError(f"{key} must hold directory paths, got {p!r}")
        out.append(os.path.expanduser(str(p).strip()))
    return tuple(out)


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """How the offloader treats saved activations. Every field has a default that works."""

    tier: Tier = "ssd"
    """Where offloaded activations go. ``"keep"``: hooks installed, everything kept in memory (the
    accounting baseline). ``"ssd"``: written to files in ``ssd_dirs``. ``"cpu"``: CUDA tensors go to
    a pinned host pool of ``host_budget_bytes`` and spill to ``ssd_dirs`` past it; CPU tensors stay
    where they are (moving host memory to host memory saves nothing)."""

    ssd_dirs: tuple[str, ...] = ()
    """Directories for the ssd tier (and the cpu tier's spill), striped chunk by chunk when several
    are given. Empty: a per-user directory on a local, non-tmpfs file system is chosen and logged."""

    min_bytes: int = 1 << 20
    """Tensors smaller than this are kept in memory: moving them costs more than it saves."""

    dedup: bool = True
    """Move a storage once even when several saved tensors (views, transposes, expands) share it."""

    staging_bytes: int = 128 << 20
    """Size of the pre-allocated, page-aligned staging pool that writes go through. When it is full,
    forward waits for writes to finish (backpressure, counted in stats)."""

    host_budget_bytes: int = 2 << 30
    """cpu tier: bytes of pinned host memory to hold activations in before spilling to ssd."""

    prefetch_bytes: int = 128 << 20
    """Backward reads ahead, in reverse pack order, at most this many bytes beyond what is in use."""

    chunk_bytes: int = 4 << 20
    """Unit of I/O and of staging slots; a multiple of 4096. Blocks are split into chunks."""

    io_threads: int = 4
    """Threads of the I/O engine (requests in flight at once)."""

    direct_io: DirectIO = "auto"
    """O_DIRECT use: ``"auto"`` tries it and falls back to buffered I/O where the file system refuses
    it (logged once, shown in stats); ``"on"`` fails instead; ``"off"`` always uses buffered I/O."""

    trim_host_bytes: int = 128 << 20
    """CPU activations on glibc: hand freed heap pages back to the OS (``malloc_trim``) each time
    this many bytes were moved out or back in; 0 disables it. Without it glibc keeps the freed
    activations' pages in its heap and the process's RSS hardly drops. Each call costs a few
    milliseconds, and pages handed back are faulted in again when reused: a trade of step time
    for RSS, measured in docs/benchmarks/."""

    engine: EngineName = "auto"
    """I/O engine. ``"native"``: the C engine (csrc/), which never needs the GIL; ``"python"``: the
    thread-pool reference engine; ``"kvikio"``: GPUDirect Storage for CUDA tensors (host tensors
    use native); ``"auto"``: kvikio for CUDA tensors where kvikio and cuFile work, else native,
    else python, logging what it picked and why. Naming an engine that cannot load is an error."""

    io_uring: IoUring = "auto"
    """Native engine backend: ``"on"`` drives an io_uring ring (error where the kernel or a seccomp
    profile refuses it), ``"off"`` uses its pthread pool, ``"auto"`` uses io_uring where a probe
    succeeds."""

    daemon_socket: str = ""
    """Unix socket of an ``offloadd serve`` daemon. When set (and the tier is ``ssd``), the daemon
    does the I/O: staging memory is shared with it, and ``ssd_dirs``/``engine`` are the daemon's
    business. Empty: the embedded engine. An unreachable daemon raises at construction."""

    def __post_init__(self) -> None:
        for key in _CHOICES:
            _check_choice(key, getattr(self, key), key)
        if isinstance(self.ssd_dirs, str):
            object.__setattr__(self, "ssd_dirs", _parse_dirs("ssd_dirs", self.ssd_dirs))
        else:
            object.__setattr__(self, "ssd_dirs", _parse_dirs("ssd_dirs", list(self.ssd_dirs)))
        for key in (
            "min_bytes",
            "staging_bytes",
            "host_budget_bytes",
            "prefetch_bytes",
            "trim_host_bytes",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be a non-negative byte count, got {value!r}")
        if not isinstance(self.daemon_socket, str):
            raise ValueError(f"daemon_socket must be a socket path, got {self.daemon_socket!r}")
        object.__setattr__(self, "daemon_socket", os.path.expanduser(self.daemon_socket.strip()))
        if not isinstance(self.dedup, bool):
            raise ValueError(f"dedup must be true or false, got {self.dedup!r}")
        cb = self.chunk_bytes
        if not isinstance(cb, int) or isinstance(cb, bool) or cb <= 0 or cb % _ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {cb!r}")
        if self.staging_bytes < cb:
            raise ValueError(
                f"staging_bytes must hold at least one chunk ({cb} bytes), got {self.staging_bytes}"
            )
        if not isinstance(self.io_threads, int) or not 1 <= self.io_threads <= 256:
            raise ValueError(f"io_threads must be an integer in 1..256, got {self.io_threads!r}")

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "config") -> Config:
        """Build from ``{field: value}``, converting strings; unknown keys raise naming ``source``."""
        names = set(cls.field_names())
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(names))}"
            )
        return cls(**{k: _convert(k, v) for k, v in values.items()})

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Config:
        """Read a TOML file whose top-level keys (or ``[offload]`` table) are field names."""
        return cls.from_mapping(read_toml(path, "offload"), source=str(path))

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, base: Config | None = None
    ) -> Config:
        """Apply ``OFFLOADD_<FIELD>`` variables (and ``OFFLOADD_CONFIG=file.toml``) over ``base``.

        An ``OFFLOADD_*`` variable that is neither a field nor reserved raises ``ValueError``, so a
        typo never silently runs with defaults."""
        env = os.environ if environ is None else environ
        cfg = base if base is not None else cls()
        if env.get("OFFLOADD_CONFIG"):
            cfg = cls.from_toml(env["OFFLOADD_CONFIG"])
        names = cls.field_names()
        overrides: dict[str, Any] = {}
        for var, value in env.items():
            if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV:
                continue
            key = var[len(ENV_PREFIX) :].lower()
            if key not in names:
                raise ValueError(
                    f"unknown environment variable {var}={value!r}; known: "
                    + ", ".join(ENV_PREFIX + n.upper() for n in names)
                )
            overrides[key] = _convert(var, value, key)
        return dataclasses.replace(cfg, **overrides)

    def replace(self, **changes: Any) -> Config:
        return self.from_mapping({**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self.field_names()}


_CHOICES: dict[str, tuple[str, ...]] = {
    "tier": get_args(Tier),
    "direct_io": get_args(DirectIO),
    "engine": get_args(EngineName),
    "io_uring": get_args(IoUring),
}


def read_toml(path: str | os.PathLike[str], table: str) -> dict[str, Any]:
    """A TOML file's ``[table]`` if it has one, else its top level; errors name the path."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {str(p)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    section = data.get(table)
    return section if isinstance(section, dict) else data


def _check_choice(label: str, value: object, key: str) -> str:
    choices = _CHOICES[key]
    if value not in choices:
        raise ValueError(f"{label} must be one of {', '.join(choices)}; got {value!r}")
    return str(value)


_SIZE_FIELDS = frozenset(
    {
        "min_bytes",
        "staging_bytes",
        "host_budget_bytes",
        "prefetch_bytes",
        "chunk_bytes",
        "trim_host_bytes",
    }
)


def _convert(label: str, value: Any, key: str | None = None) -> Any:
    """Convert a TOML/env value for field ``key`` (defaults to ``label``); errors name ``label``."""
    key = key or label
    if key in _SIZE_FIELDS:
        return parse_size(label, value)
    if key == "io_threads":
        return _parse_int(label, value)
    if key == "dedup":
        return _parse_bool(label, value)
    if key == "ssd_dirs":
        return _parse_dirs(label, value)
    if key == "daemon_socket":
        if not isinstance(value, str):
            raise ValueError(f"{label} must be a socket path, got {value!r}")
        return value
    return _check_choice(label, value, key)
