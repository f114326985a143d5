"""The one loader: the defaults (or a base config), then a TOML file, then ``OFFLOADD_*`` variables.

A file's top level, or its ``[offload]`` table, holds :class:`~offloadd.config.Config` keys; its
``[daemon]`` table (``[offload.daemon]`` inside an ``[offload]`` table) holds the section's. In
the environment a key is ``OFFLOADD_<KEY>`` and a section key ``OFFLOADD_DAEMON_<KEY>``; no key
of the top level starts with ``daemon_``, so the two never collide. The variables of
:data:`RESERVED_ENV` are not keys (offloadd reads them elsewhere); any other ``OFFLOADD_*``
variable that names no key is an error.

Every value, wherever it came from, is read by its field's kind (:mod:`offloadd.config.kinds`)
under its dotted key and its source, so a bad one raises ``daemon.quota_bytes: '12 apples' is
not a size ... (from OFFLOADD_DAEMON_QUOTA_BYTES)``; unknown keys raise naming each one and the
valid ones.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from offloadd.config.daemon import KINDS as DAEMON_KINDS
from offloadd.config.daemon import SECTION, DaemonConfig
from offloadd.config.kinds import check, invalid
from offloadd.config.renamed import move_renamed
from offloadd.config.schema import KINDS, Config

__all__ = [
    "DAEMON_ENV_PREFIX",
    "ENV_PREFIX",
    "RESERVED_ENV",
    "Flat",
    "build",
    "env_var",
    "flatten",
    "from_environ",
    "load",
    "load_daemon",
    "read_file",
]

ENV_PREFIX = "OFFLOADD_"
DAEMON_ENV_PREFIX = f"{ENV_PREFIX}{SECTION.upper()}_"
#: ``OFFLOADD_*`` variables that are not config keys but are read by other parts of offloadd.
RESERVED_ENV = frozenset(
    {"OFFLOADD", "OFFLOADD_CONFIG", "OFFLOADD_REPORT", "OFFLOADD_LOG", "OFFLOADD_MEMSAVE_KERNELS"}
)
"""Read elsewhere: the switch, the config file, the report and log destinations
(:mod:`offloadd.integrations`), and memsave's kernels (:mod:`offloadd.memsave.kernels`, a
process-wide switch for a diagnosis, not a setting of a run)."""

Flat = dict[str, tuple[object, str | None]]
"""Dotted key -> (the value as given, where it came from: a file, a variable; None: code)."""


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    base: Config | None = None,
) -> Config:
    """:meth:`Config.load <offloadd.config.Config.load>`: ``base``, then the file (``path``,
    else ``$OFFLOADD_CONFIG``), then ``environ`` (default: ``os.environ``), each key over the
    one before."""
    env = os.environ if environ is None else environ
    flat = flatten(base.as_dict(), None) if base is not None else {}
    file = path if path is not None else (env.get("OFFLOADD_CONFIG") or None)
    if file is not None:
        flat.update(flatten(read_file(file), str(file)))
    flat.update(from_environ(env))
    return build(flat)


def load_daemon(
    path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None
) -> DaemonConfig:
    """The section as ``offloadd serve``, ``status`` and ``stop`` read it: :func:`load` of
    ``path`` with only the ``OFFLOADD_DAEMON_*`` variables of ``environ`` (default:
    ``os.environ``). The training side's variables, ``OFFLOADD_CONFIG`` too, are not read: they
    are not the daemon's business, and the daemon's process often inherits them. A file of
    daemon keys alone, without a ``[daemon]`` table, is read as that table."""
    env = os.environ if environ is None else environ
    flat: Flat = {}
    if path is not None:
        data = read_file(path)
        if data and SECTION not in data and all(k in DAEMON_KINDS for k in data):
            # Only daemon keys, at the top: a daemon's own file, as configs/daemon.toml was
            # before the daemon's settings became a section. Read as its [daemon] table.
            data = {SECTION: data}
        flat.update(flatten(data, str(path)))
    flat.update(from_environ({k: v for k, v in env.items() if k.startswith(DAEMON_ENV_PREFIX)}))
    return build(flat).daemon


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A TOML file's keys as :func:`flatten` takes them: the ``[offload]`` table if there is
    one (with the top-level ``[daemon]`` table moved into it), else the top level."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {str(p)!r} does not exist") from None
    except OSError as e:
        raise ValueError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    table = data.get("offload")
    if not isinstance(table, dict):
        return data
    rest = {k: v for k, v in data.items() if k != "offload"}
    if SECTION in rest:
        if SECTION in table:
            raise ValueError(
                f"{SECTION}: given twice, as [{SECTION}] and [offload.{SECTION}] (from {p})"
            )
        table = {**table, SECTION: rest.pop(SECTION)}
    if rest:
        raise ValueError(
            f"{', '.join(sorted(rest))}: outside the [offload] and [{SECTION}] tables (from {p}); "
            "in a file with an [offload] table, every key belongs to one of them"
        )
    return table


def flatten(values: Mapping[str, Any], source: str | None) -> Flat:
    """``{key: value}`` (``daemon``: a table or a DaemonConfig) as dotted keys, each with
    ``source``; renamed keys are read with a warning ([renamed keys] in config/renamed.py),
    unknown keys raise."""
    if source is None:
        values = move_renamed(values, "a mapping", "keyword")
    else:
        values = move_renamed(values, source, "file")
    _reject_unknown(values, (*KINDS, SECTION), "", source)
    flat: Flat = {}
    for key, value in values.items():
        if key != SECTION:
            flat[key] = (value, source)
            continue
        section = value.as_dict() if isinstance(value, DaemonConfig) else value
        if not isinstance(section, Mapping):
            raise invalid(SECTION, value, f"a table of the [{SECTION}] settings", source)
        _reject_unknown(section, tuple(DAEMON_KINDS), f"{SECTION}.", source)
        for name, v in section.items():
            flat[f"{SECTION}.{name}"] = (v, source)
    return flat


def from_environ(environ: Mapping[str, str]) -> Flat:
    """The ``OFFLOADD_<KEY>`` and ``OFFLOADD_DAEMON_<KEY>`` variables of ``environ``, each with
    its name as the source; any other ``OFFLOADD_*`` variable not in RESERVED_ENV raises."""
    flat: Flat = {}
    for var, value in environ.items():
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        in_section = name.removeprefix(f"{SECTION}_")
        if name.startswith(f"{SECTION}_") and in_section in DAEMON_KINDS:
            flat[f"{SECTION}.{in_section}"] = (value, var)
        elif name in KINDS:
            flat[name] = (value, var)
        elif name.startswith(SECTION):
            known = ", ".join(env_var(f"{SECTION}.{k}") for k in DAEMON_KINDS)
            raise ValueError(f"unknown environment variable {var}={value!r}; known: {known}")
        else:
            known = ", ".join(env_var(k) for k in KINDS)
            raise ValueError(
                f"unknown environment variable {var}={value!r}; known: {known}, and "
                f"{DAEMON_ENV_PREFIX}<KEY> for the keys of the [{SECTION}] section"
            )
    return flat


def env_var(key: str) -> str:
    """The variable of a dotted key: ``daemon.quota_bytes`` -> ``OFFLOADD_DAEMON_QUOTA_BYTES``."""
    return ENV_PREFIX + key.replace(".", "_").upper()


def build(flat: Flat) -> Config:
    """Read every value by its kind, naming its dotted key and source, then construct."""
    top: dict[str, Any] = {}
    section: dict[str, Any] = {}
    for key, (value, source) in flat.items():
        name = key.removeprefix(f"{SECTION}.")
        if name != key:
            section[name] = check(key, DAEMON_KINDS[name], value, source)
        else:
            top[key] = check(key, KINDS[key], value, source)
    try:
        return Config(**top, daemon=DaemonConfig(**section))
    except ValueError as e:  # every value is good alone: a rule between keys is broken
        sources = list(dict.fromkeys(s for _, s in flat.values() if s is not None))
        if not sources:
            raise
        raise ValueError(f"{e} (values from {', '.join(sources)})") from None


def _reject_unknown(
    values: Mapping[str, Any], names: tuple[str, ...], prefix: str, source: str | None
) -> None:
    unknown = sorted(str(k) for k in values if k not in names)
    if not unknown:
        return
    where = f" (from {source})" if source else ""
    table = prefix.rstrip(".") or "offload"
    hints = "".join(_hint(k) for k in unknown) if not prefix else ""
    raise ValueError(
        f"{', '.join(prefix + k for k in unknown)}: unknown key{'s' if len(unknown) > 1 else ''}"
        f"{where}; the [{table}] keys are: {', '.join(sorted(names))}{hints}"
    )


def _hint(key: str) -> str:
    """For an unknown top-level key that is (or looks like) a key of the daemon's section."""
    name = key.removeprefix(f"{SECTION}_")
    if name in DAEMON_KINDS and name not in KINDS:
        return (
            f"; did you mean {SECTION}.{name} (in TOML: {name} in the [{SECTION}] table; "
            f"in Python: {SECTION}={{{name!r}: ...}})?"
        )
    return ""
