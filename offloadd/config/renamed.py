"""Keys renamed since the first release, read under their old names until :data:`REMOVED_IN`.

Note: [renamed keys]
~~~~~~~~~~~~~~~~~~~~
:data:`RENAMED` maps each old key to the dotted key it became. The first release's
``daemon_socket`` (the socket of the daemon that does the I/O) became ``daemon.socket`` when the
daemon's settings became the ``daemon`` section. The codec's flat keys became the
``codec`` section: ``codec`` (the codec's name) is ``codec.name``, ``codec_<key>`` is
``codec.<key>``. Every place a user gives keys reads the old names: keyword arguments
(``Offloader(**kw)`` and ``Config.replace`` through :func:`move_renamed`, ``Config(...)``
through :func:`reads_renamed`), a mapping or TOML file (its top level or ``[offload]`` table,
through :func:`move_renamed` in the loader's ``flatten``) and the environment (the loader's
``from_environ``, for the one old variable spelled otherwise than its new key's:
``OFFLOADD_CODEC``, now ``OFFLOADD_CODEC_NAME``; ``OFFLOADD_DAEMON_SOCKET`` and
``OFFLOADD_CODEC_<KEY>`` are spelled as the new keys' variables and are not deprecated). Each
old name read is a :class:`DeprecationWarning` naming it, its new key and where it came from,
attributed to the first caller outside offloadd so that Python's default filters show it for
a script's own lines.

``codec`` is both an old key and a section: given a table (or a :class:`CodecConfig`) it is
the section, given anything else (``codec="int8"``) the old key of ``codec.name``.

Within one place (one call, one file, one environment) an old key and its new key with
different values are a :class:`ValueError` naming both: neither can be said to win. Across
places the usual order holds (the environment over the file over the base), because each place
is read on its own first.

Every rename so far moves a top-level key into a section, so an entry's new key is
``<section>.<name>``; a rename of another shape would extend :func:`move_renamed`.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, Literal, TypeVar

from offloadd.config.fields import Settings, kind_of, sections
from offloadd.config.validators import check, invalid

__all__ = [
    "REMOVED_IN",
    "RENAMED",
    "Form",
    "move_renamed",
    "old_class_name",
    "reads_renamed",
    "renamed_variables",
    "warn_renamed",
]

RENAMED: dict[str, str] = {
    "daemon_socket": "daemon.socket",
    # codec first: while it holds the old name's value, codec is no section to move keys into
    "codec": "codec.name",
    "codec_group": "codec.group",
    "codec_symmetric": "codec.symmetric",
    "codec_stochastic": "codec.stochastic",
    "codec_seed": "codec.seed",
    "codec_min_bytes": "codec.min_bytes",
    "codec_ops": "codec.ops",
}
"""Old key -> the dotted key it became (see [renamed keys])."""

REMOVED_IN = "0.3.0"
"""The release that stops reading the old names (the first release was 0.1.0; they are read
through the next one)."""

Form = Literal["keyword", "file"]
"""How the caller writes keys: Python keyword arguments, or a TOML file (a mapping like one)."""

S = TypeVar("S", bound=type[Settings])


def move_renamed(
    root: type[Settings], values: Mapping[str, Any], source: str, form: Form
) -> dict[str, Any]:
    """A copy of ``values`` (the keys of ``root``, each section as a mapping or an instance of
    its class) with each old key moved into its section, warning for each; an old and a new key
    of different values raise. A section given as an instance stays one, with the old key's
    value set in it; a mapping, or no section, becomes a mapping of the keys given."""
    out = dict(values)
    classes = sections(root)
    for old, new in RENAMED.items():
        if old not in out or _is_section(classes, old, out[old]):
            continue
        name_of_section, name = new.split(".")
        cls = classes[name_of_section]
        value = out.pop(old)
        held = out.get(name_of_section)
        if isinstance(held, cls):
            given = getattr(held, name)
            if given == getattr(cls(), name):  # the default: the key was not given
                given = _NOT_GIVEN
        elif isinstance(held, Mapping):
            given = held.get(name, _NOT_GIVEN)
        elif held is None:
            given = _NOT_GIVEN
        else:
            what = f"a table of the [{name_of_section}] settings"
            raise invalid(name_of_section, held, what, source)
        kind = kind_of(next(f for f in fields(cls) if f.name == name))
        if given is not _NOT_GIVEN and check(new, kind, given, source) != check(
            old, kind, value, source
        ):
            raise ValueError(
                f"{old}, {new}: both given, as {value!r} and {given!r} (from {source}); {old} "
                f"is the deprecated name of {new}: give {new} alone"
            )
        warn_renamed(old, new, source, _spelling(name_of_section, name, form))
        if isinstance(held, Settings):
            out[name_of_section] = held.replace(**{name: value})
        elif isinstance(held, Mapping):
            out[name_of_section] = {**held, name: value}
        else:
            out[name_of_section] = {name: value}
    return out


def renamed_variables(variable: Callable[[str], str]) -> dict[str, str]:
    """``{old variable: new dotted key}`` for the old keys whose variable (``variable(key)``)
    is not their new key's; the others need no rename in the environment."""
    return {variable(old): new for old, new in RENAMED.items() if variable(old) != variable(new)}


def reads_renamed(cls: S) -> S:
    """``cls`` (the root dataclass) whose constructor reads the old names of its keyword
    arguments too, as :func:`move_renamed` does (type checkers see the fields alone)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Settings, **kw: Any) -> None:
        init(self, **move_renamed(cls, kw, "a keyword argument", "keyword"))

    cls.__init__ = __init__  # type: ignore[assignment,method-assign]
    return cls


def old_class_name(module: str, name: str, config: type[Settings]) -> Any:
    """A module ``__getattr__``'s answer for the first release's ``OffloadConfig`` (now
    ``config``, :class:`~offloadd.Config`), with a DeprecationWarning; AttributeError for any
    other missing name."""
    if name != "OffloadConfig":
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    warnings.warn(
        f"{module}.OffloadConfig is deprecated: it is {module}.Config now; "
        f"offloadd {REMOVED_IN} no longer has OffloadConfig",
        DeprecationWarning,
        stacklevel=3,
    )
    return config


def warn_renamed(old: str, new: str, source: str, spelling: str) -> None:
    """The DeprecationWarning of an old name, attributed to the first caller outside offloadd."""
    warnings.warn(
        f"{old} (from {source}) is deprecated: it is {new} now, written {spelling}; offloadd "
        f"{REMOVED_IN} no longer reads {old}",
        DeprecationWarning,
        stacklevel=_outside_offloadd(),
    )


_NOT_GIVEN: Any = object()


def _is_section(classes: Mapping[str, type[Settings]], key: str, value: object) -> bool:
    """Whether ``value`` under ``key`` is a section's (a table, an instance), not an old key's."""
    cls = classes.get(key)
    return cls is not None and isinstance(value, cls | Mapping)


def _spelling(name_of_section: str, name: str, form: Form) -> str:
    if form == "keyword":
        return f"{name_of_section}={{{name!r}: ...}}"
    return f"{name} = ... in the [{name_of_section}] table"


def _outside_offloadd() -> int:
    """warnings.warn's stacklevel, called from :func:`warn_renamed`, of the nearest frame whose
    module is not offloadd's (the dataclass's generated ``__init__`` runs in its class's module,
    so frames are told apart by module name, not by file)."""
    level, frame = 2, sys._getframe(2)
    while frame.f_back is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module != "offloadd" and not module.startswith("offloadd."):
            break
        frame, level = frame.f_back, level + 1
    return level
