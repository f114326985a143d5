"""Keys renamed since the first release, read under their old names until :data:`REMOVED_IN`.

Note: [renamed keys]
~~~~~~~~~~~~~~~~~~~~
:data:`RENAMED` maps each old key to the dotted key it became. The first release's
``daemon_socket`` (the socket of the daemon that does the I/O) became ``daemon.socket`` when the
daemon's settings became the ``daemon`` section (eefab01); no other key of the first release
was renamed or moved. Every place a user gives keys reads the old name: keyword arguments
(``Offloader(**kw)`` and ``Config.replace`` through :func:`move_renamed`, ``Config(...)``
through its ``daemon_socket`` InitVar), a mapping or TOML file (its top level or ``[offload]``
table, through :func:`move_renamed` in the loader's ``flatten``). Each old name read is a :class:`DeprecationWarning` naming it, its new key
and where it came from, attributed to the first caller outside offloadd so that Python's
default filters show it for a script's own lines.

Within one place (one call, one file, one environment) an old key and its new key with
different values are a :class:`ValueError` naming both: neither can be said to win. Across
places the usual order holds (the environment over the file over the base), because each place
is read on its own first. The environment has nothing to deprecate: ``daemon_socket``'s
variable, ``OFFLOADD_DAEMON_SOCKET``, is spelled as ``daemon.socket``'s. A later rename that
changes a variable's spelling would add its old variable to the loader's ``from_environ``.

Only moves into the daemon's section have happened, so an entry's new key is ``daemon.<name>``;
a rename of another shape would extend :func:`move_renamed`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from offloadd.config.daemon import KINDS as DAEMON_KINDS
from offloadd.config.daemon import SECTION, DaemonConfig
from offloadd.config.kinds import check, invalid

__all__ = ["REMOVED_IN", "RENAMED", "Form", "move_renamed", "old_class_name", "warn_renamed"]

RENAMED: dict[str, str] = {"daemon_socket": f"{SECTION}.socket"}
"""Old key -> the dotted key it became (see [renamed keys])."""

REMOVED_IN = "0.3.0"
"""The release that stops reading the old names (the first release was 0.1.0; they are read
through the next one)."""

Form = Literal["keyword", "file"]
"""How the caller writes keys: Python keyword arguments, or a TOML file (a mapping like one)."""


def move_renamed(values: Mapping[str, Any], source: str, form: Form) -> dict[str, Any]:
    """A copy of ``values`` (top-level keys, the section under ``daemon`` as a mapping or a
    :class:`DaemonConfig`) with each old key moved into the section, warning for each; an old
    and a new key of different values raise. A DaemonConfig stays one (the whole section), with
    the old key's value set in it; a mapping, or no section, becomes a mapping of keys given."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old not in out:
            continue
        name = new.removeprefix(f"{SECTION}.")
        value = out.pop(old)
        section = out.get(SECTION)
        if isinstance(section, DaemonConfig):
            given = getattr(section, name)
            if given == getattr(DaemonConfig(), name):  # the default: the key was not given
                given = _NOT_GIVEN
        elif isinstance(section, Mapping):
            given = section.get(name, _NOT_GIVEN)
        elif section is None:
            given = _NOT_GIVEN
        else:
            raise invalid(SECTION, section, f"a table of the [{SECTION}] settings", source)
        kind = DAEMON_KINDS[name]
        if given is not _NOT_GIVEN and check(new, kind, given, source) != check(
            old, kind, value, source
        ):
            raise ValueError(
                f"{old}, {new}: both given, as {value!r} and {given!r} (from {source}); {old} "
                f"is the deprecated name of {new}: give {new} alone"
            )
        warn_renamed(old, new, source, _spelling(name, form))
        if isinstance(section, DaemonConfig):
            out[SECTION] = section.replace(**{name: value})
        else:
            out[SECTION] = {**(section or {}), name: value}
    return out


def old_class_name(module: str, name: str) -> Any:
    """A module ``__getattr__``'s answer for the first release's ``OffloadConfig`` (now
    :class:`~offloadd.Config`, the same keys), with a DeprecationWarning; AttributeError for
    any other missing name."""
    if name != "OffloadConfig":
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    from offloadd.config.schema import Config

    warnings.warn(
        f"{module}.OffloadConfig is deprecated: it is {module}.Config now, with the same keys; "
        f"offloadd {REMOVED_IN} no longer has OffloadConfig",
        DeprecationWarning,
        stacklevel=3,
    )
    return Config


def warn_renamed(old: str, new: str, source: str, spelling: str) -> None:
    """The DeprecationWarning of an old name, attributed to the first caller outside offloadd."""
    warnings.warn(
        f"{old} (from {source}) is deprecated: it is {new} now, written {spelling}; offloadd "
        f"{REMOVED_IN} no longer reads {old}",
        DeprecationWarning,
        stacklevel=_outside_offloadd(),
    )


_NOT_GIVEN: Any = object()


def _spelling(name: str, form: Form) -> str:
    if form == "keyword":
        return f"{SECTION}={{{name!r}: ...}}"
    return f"{name} = ... in the [{SECTION}] table"


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
