"""The one loader: the defaults (or a base config), then a TOML file, then ``OFFLOADD_*`` variables.

Each function takes the root class (:class:`~offloadd.config.Config`) and learns its keys and
sections from the fields' metadata (:mod:`offloadd.config.fields`), so the loader imports no
schema. A file's top level, or its ``[offload]`` table, holds the root's keys; a section's table
(``[daemon]``, ``[codec]``; ``[offload.daemon]`` inside an ``[offload]`` table) holds the
section's. In the environment a key is ``OFFLOADD_<KEY>`` and a section key
``OFFLOADD_<SECTION>_<KEY>``; no key of the top level starts with a section's name and ``_``, so
the two never collide. The variables of :data:`RESERVED_ENV` are not keys (offloadd reads them
elsewhere); any other ``OFFLOADD_*`` variable that names no key is an error.

Every value, wherever it came from, is read by its field's kind (:mod:`offloadd.config.validators`)
under its dotted key and its source, so a bad one raises ``daemon.quota_bytes: '12 apples' is
not a size ... (from OFFLOADD_DAEMON_QUOTA_BYTES)``; unknown keys raise naming each one and the
valid ones. Old names are read with a warning ([renamed keys] in config/renamed.py).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from offloadd.config.fields import Settings, keys, sections
from offloadd.config.renamed import RENAMED, move_renamed, renamed_variables, warn_renamed
from offloadd.config.validators import check, invalid

__all__ = [
    "ENV_PREFIX",
    "RESERVED_ENV",
    "Flat",
    "build",
    "env_var",
    "flatten",
    "from_environ",
    "load",
    "load_section",
    "read_file",
]

ENV_PREFIX = "OFFLOADD_"
#: ``OFFLOADD_*`` variables that are not config keys but are read by other parts of offloadd.
RESERVED_ENV = frozenset(
    {
        "OFFLOADD",
        "OFFLOADD_CONFIG",
        "OFFLOADD_REPORT",
        "OFFLOADD_LOG",
        "OFFLOADD_MEMSAVE_KERNELS",
        "OFFLOADD_TEST_DIR",
    }
)
"""Read elsewhere: the switch, the config file, the report and log destinations
(:mod:`offloadd.integrations`), memsave's kernels (:mod:`offloadd.memsave.kernels`, a
process-wide switch for a diagnosis, not a setting of a run), and the test suite's directory
(tests/conftest.py), which every Offloader built under it would otherwise refuse."""

Flat = dict[str, tuple[object, str | None]]
"""Dotted key -> (the value as given, where it came from: a file, a variable; None: code)."""

R = TypeVar("R", bound=Settings)


def load(
    root: type[R],
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    base: R | None = None,
) -> R:
    """:meth:`Config.load <offloadd.config.Config.load>`: ``base``, then the file (``path``,
    else ``$OFFLOADD_CONFIG``), then ``environ`` (default: ``os.environ``), each key over the
    one before."""
    env = os.environ if environ is None else environ
    flat = flatten(root, base.as_dict(), None) if base is not None else {}
    file = path if path is not None else (env.get("OFFLOADD_CONFIG") or None)
    if file is not None:
        flat.update(flatten(root, read_file(root, file), str(file)))
    flat.update(from_environ(root, env))
    return build(root, flat)


def load_section(
    root: type[Settings],
    name: str,
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Any:
    """One section, as a program that reads only it loads it (``offloadd serve`` the daemon's):
    :func:`load` of ``path`` with only the ``OFFLOADD_<SECTION>_*`` variables of ``environ``
    (default: ``os.environ``). Other variables, ``OFFLOADD_CONFIG`` too, are not read: they are
    not its business, and its process often inherits them. A file of the section's keys alone,
    without its table, is read as that table (as configs/daemon.toml was written before the
    daemon's settings became a section)."""
    env = os.environ if environ is None else environ
    prefix = env_var(name) + "_"
    flat: Flat = {}
    if path is not None:
        data = read_file(root, path)
        names = keys(sections(root)[name])
        if data and name not in data and all(k in names for k in data):
            data = {name: data}
        flat.update(flatten(root, data, str(path)))
    flat.update(from_environ(root, {k: v for k, v in env.items() if k.startswith(prefix)}))
    return getattr(build(root, flat), name)


def read_file(root: type[Settings], path: str | os.PathLike[str]) -> dict[str, Any]:
    """A TOML file's keys as :func:`flatten` takes them: the ``[offload]`` table if there is
    one (with the top-level section tables moved into it), else the top level."""
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
    names = tuple(sections(root))
    for name in names:
        if name not in rest:
            continue
        if isinstance(table.get(name), dict):
            raise ValueError(f"{name}: given twice, as [{name}] and [offload.{name}] (from {p})")
        if name in table:  # an old key of that name (codec = "int8"): see [renamed keys]
            raise ValueError(
                f"{name}: given as a key of [offload] ({table[name]!r}) and as the [{name}] "
                f"table (from {p}); the key is the deprecated name of {RENAMED.get(name, name)}: "
                f"give that in the [{name}] table alone"
            )
        table = {**table, name: rest.pop(name)}
    if rest:
        tables = ", ".join(f"[{n}]" for n in ("offload", *names))
        raise ValueError(
            f"{', '.join(sorted(rest))}: outside the {tables} tables (from {p}); "
            "in a file with an [offload] table, every key belongs to one of them"
        )
    return table


def flatten(root: type[Settings], values: Mapping[str, Any], source: str | None) -> Flat:
    """``{key: value}`` (a section: a table or an instance of its class) as dotted keys, each
    with ``source``; renamed keys are read with a warning ([renamed keys] in config/renamed.py),
    unknown keys raise."""
    if source is None:
        values = move_renamed(root, values, "a mapping", "keyword")
    else:
        values = move_renamed(root, values, source, "file")
    classes = sections(root)
    _reject_unknown(root, values, (*keys(root), *classes), "", source)
    flat: Flat = {}
    for key, value in values.items():
        if key not in classes:
            flat[key] = (value, source)
            continue
        table = value.as_dict() if isinstance(value, classes[key]) else value
        if not isinstance(table, Mapping):
            raise invalid(key, value, f"a table of the [{key}] settings", source)
        _reject_unknown(root, table, tuple(keys(classes[key])), f"{key}.", source)
        for name, v in table.items():
            flat[f"{key}.{name}"] = (v, source)
    return flat


def from_environ(root: type[Settings], environ: Mapping[str, str]) -> Flat:
    """The ``OFFLOADD_<KEY>`` and ``OFFLOADD_<SECTION>_<KEY>`` variables of ``environ``, each
    with its name as the source; an old key's variable spelled otherwise than its new key's is
    read with a warning, and any other ``OFFLOADD_*`` variable not in RESERVED_ENV raises."""
    known = _variables(root)
    old = renamed_variables(env_var)
    flat: Flat = {}
    moved: Flat = {}
    for var, value in environ.items():
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV:
            continue
        upper = var.upper()
        if upper in known:
            flat[known[upper]] = (value, var)
        elif upper in old:
            new = old[upper]
            warn_renamed(var, new, "the environment", env_var(new))
            moved[new] = (value, var)
        else:
            raise ValueError(_unknown_variable(root, var, value))
    for key, given in moved.items():
        if key in flat and _read(root, key, flat[key]) != _read(root, key, given):
            (old_value, old_var), (new_value, new_var) = given, flat[key]
            raise ValueError(
                f"{old_var}, {new_var}: both given, as {old_value!r} and {new_value!r}; "
                f"{old_var} is the deprecated name of {new_var} ({key}): give {new_var} alone"
            )
        flat.setdefault(key, given)
    return flat


def env_var(key: str) -> str:
    """The variable of a dotted key: ``daemon.quota_bytes`` -> ``OFFLOADD_DAEMON_QUOTA_BYTES``."""
    return ENV_PREFIX + key.replace(".", "_").upper()


def build(root: type[R], flat: Flat) -> R:
    """Read every value by its kind, naming its dotted key and source, then construct."""
    classes = sections(root)
    top: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {name: {} for name in classes}
    for key, given in flat.items():
        name_of_section, _, name = key.rpartition(".")
        value = _read(root, key, given)
        if name_of_section:
            tables[name_of_section][name] = value
        else:
            top[key] = value
    try:
        built = {name: classes[name](**table) for name, table in tables.items()}
        return root(**top, **built)
    except ValueError as e:  # every value is good alone: a rule between keys is broken
        sources = list(dict.fromkeys(s for _, s in flat.values() if s is not None))
        if not sources:
            raise
        raise ValueError(f"{e} (values from {', '.join(sources)})") from None


def _read(root: type[Settings], key: str, given: tuple[object, str | None]) -> Any:
    """A dotted key's value read by its field's kind, errors naming the key and the source."""
    name_of_section, _, name = key.rpartition(".")
    cls = sections(root)[name_of_section] if name_of_section else root
    return check(key, keys(cls)[name], given[0], given[1])


def _variables(root: type[Settings]) -> dict[str, str]:
    """``{variable: dotted key}`` of every key of ``root`` and of its sections."""
    out = {env_var(k): k for k in keys(root)}
    for name, cls in sections(root).items():
        out.update({env_var(f"{name}.{k}"): f"{name}.{k}" for k in keys(cls)})
    return out


def _unknown_variable(root: type[Settings], var: str, value: str) -> str:
    """The error of an ``OFFLOADD_*`` variable that names no key: the variables it could be."""
    for name, cls in sections(root).items():
        if var.upper().startswith(env_var(name)):
            known = ", ".join(env_var(f"{name}.{k}") for k in keys(cls))
            return f"unknown environment variable {var}={value!r}; known: {known}"
    known = ", ".join(env_var(k) for k in keys(root))
    rest = ", ".join(
        f"{env_var(name)}_<KEY> for the keys of the [{name}] section" for name in sections(root)
    )
    return f"unknown environment variable {var}={value!r}; known: {known}, and {rest}"


def _reject_unknown(
    root: type[Settings],
    values: Mapping[str, Any],
    names: tuple[str, ...],
    prefix: str,
    source: str | None,
) -> None:
    unknown = sorted(str(k) for k in values if k not in names)
    if not unknown:
        return
    where = f" (from {source})" if source else ""
    table = prefix.rstrip(".") or "offload"
    hints = "".join(_hint(root, k) for k in unknown) if not prefix else ""
    raise ValueError(
        f"{', '.join(prefix + k for k in unknown)}: unknown key{'s' if len(unknown) > 1 else ''}"
        f"{where}; the [{table}] keys are: {', '.join(sorted(names))}{hints}"
    )


def _hint(root: type[Settings], key: str) -> str:
    """For an unknown top-level key that is (or looks like) a key of a section."""
    for section, cls in sections(root).items():
        name = key.removeprefix(f"{section}_")
        if name in keys(cls) and name not in keys(root):
            return (
                f"; did you mean {section}.{name} (in TOML: {name} in the [{section}] table; "
                f"in Python: {section}={{{name!r}: ...}})?"
            )
    return ""
