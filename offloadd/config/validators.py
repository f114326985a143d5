"""How one config value is read and checked, whatever it came from: TOML, the environment or code.

Each field of :class:`~offloadd.config.Config` and of its sections carries a *kind* in its
metadata (see :mod:`offloadd.config.fields`). A kind takes the value as given (a TOML value, an
environment string, a Python value) and returns it converted and checked, or raises
:class:`Rejected`; :func:`check` turns that into the one error format of the configuration,
``<dotted key>: <value> is not <what the kind accepts> (from <source>)``, as in
``daemon.quota_bytes: '12 apples' is not a size ... (from OFFLOADD_DAEMON_QUOTA_BYTES)``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, Literal, Protocol

__all__ = [
    "Bool",
    "Budget",
    "Choice",
    "DirectIO",
    "Dirs",
    "Int",
    "Kind",
    "Names",
    "Rejected",
    "Size",
    "SocketPath",
    "Uids",
    "check",
    "invalid",
    "parse_size",
]

DirectIO = Literal["auto", "on", "off"]
"""O_DIRECT use, a setting of both the training side (``direct_io``) and the daemon's."""

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_SIZE_EXAMPLE = "such as 1048576 or '1MiB'"


class Rejected(Exception):
    """A value is not of its kind; :func:`check` says which key, value and source."""


class Kind(Protocol):
    what: str
    """What the kind accepts, as it ends the sentence ``<value> is not ...``."""

    def read(self, value: object) -> Any:
        """``value`` converted and checked; raises :class:`Rejected` if it is not of this kind."""
        ...


def invalid(label: str, value: object, what: str, source: str | None = None) -> ValueError:
    """The configuration's error: ``label: value is not what (from source)``."""
    where = f" (from {source})" if source else ""
    return ValueError(f"{label}: {value!r} is not {what}{where}")


def check(label: str, kind: Kind, value: object, source: str | None = None) -> Any:
    """``kind.read(value)``, with a rejection raised as :func:`invalid` names it."""
    try:
        return kind.read(value)
    except Rejected:
        raise invalid(label, value, kind.what, source) from None


def _bytes(value: object) -> int | None:
    """A byte count from an int or a string like ``'4MiB'``; None if it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            num, unit, suffix = int(m.group(1)), m.group(2).lower(), m.group(3).lower()
            base = 1000 if (unit and suffix == "b") else 1024
            return num * base ** _UNITS[unit]
    return None


def parse_size(key: str, value: object) -> int:
    """Parse ``value`` (int or string like ``'4MiB'``) as a byte count; errors name ``key``.

    For command-line options (``--quota-bytes``); config fields use :class:`Size`."""
    n = _bytes(value)
    if n is None:
        raise ValueError(f"{key} must be a byte count {_SIZE_EXAMPLE}, got {value!r}")
    return n


def _show_bytes(n: int) -> str:
    """``n`` as it could be written in a config: ``'1GiB'`` where a binary unit divides it."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


class Size:
    """A byte count: an integer or a string with a binary/decimal suffix (``4MiB``, ``1G``)."""

    def __init__(self, low: int = 0, high: int | None = None, *, multiple: int = 1) -> None:
        self.low, self.high, self.multiple = low, high, multiple
        if multiple > 1:
            self.what = f"a size that is a positive multiple of {multiple} bytes ({_SIZE_EXAMPLE})"
        elif high is not None:
            self.what = f"a size in {_show_bytes(low)}..{_show_bytes(high)} ({_SIZE_EXAMPLE})"
        elif low:
            self.what = f"a size of at least {_show_bytes(low)} ({_SIZE_EXAMPLE})"
        else:
            self.what = f"a size (a byte count {_SIZE_EXAMPLE})"

    def read(self, value: object) -> int:
        n = _bytes(value)
        if n is None or n < self.low or (self.high is not None and n > self.high):
            raise Rejected
        if n % self.multiple:
            raise Rejected
        return n


class Budget:
    """Off (``None``, ``"off"``), a byte count (``6GiB``), or a fraction of keep's footprint
    written with an ``x`` (``"0.3x"``, or the float ``0.3``): read as an int for bytes, a float
    for a fraction."""

    what = "a memory budget: a size (6GiB, 512MiB), a fraction of keep's footprint (0.3x), or off"

    def read(self, value: object) -> int | float | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "off")):
            return None
        if isinstance(value, float):
            if not 0 < value < float("inf"):
                raise Rejected
            return value
        if isinstance(value, str) and value.strip().lower().endswith("x"):
            try:
                f = float(value.strip()[:-1])
            except ValueError:
                raise Rejected from None
            if not 0 < f < float("inf"):
                raise Rejected
            return f
        n = _bytes(value.strip() if isinstance(value, str) else value)
        if n is None or n <= 0:
            raise Rejected
        return n


class Int:
    """An integer in ``low..high`` (a string of digits too)."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.what = f"an integer in {low}..{high}"

    def read(self, value: object) -> int:
        n: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            n = int(value)
        if n is None or not self.low <= n <= self.high:
            raise Rejected
        return n


class Bool:
    """true/false (1/0, yes/no, on/off as strings)."""

    what = "a boolean (true/false, 1/0, yes/no, on/off)"

    def read(self, value: object) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        raise Rejected


class Choice:
    """One of a few words."""

    def __init__(self, choices: Sequence[str]) -> None:
        self.choices = tuple(choices)
        self.what = f"one of {', '.join(self.choices)}"

    def read(self, value: object) -> str:
        if not isinstance(value, str) or value not in self.choices:
            raise Rejected
        return value


def _items(value: object, separators: str) -> list[object]:
    """A list or tuple as it is; a string split at ``separators`` (blank items dropped)."""
    if isinstance(value, str):
        return [p for p in re.split(separators, value) if p.strip()]
    if isinstance(value, list | tuple):
        return list(value)
    raise Rejected


class Dirs:
    """Directories: a list, or one string of them separated by ``,`` or ``:``; ``~`` expanded."""

    what = "a list of directories (or one string of them separated by ',' or ':')"

    def read(self, value: object) -> tuple[str, ...]:
        out = []
        for p in _items(value, r"[,:]"):
            if not isinstance(p, str | os.PathLike) or not str(p).strip():
                raise Rejected
            out.append(os.path.expanduser(str(p).strip()))
        return tuple(out)


class Names:
    """Names: a list of identifiers, or one string of them separated by commas or blanks."""

    what = "a list of names (or one string of them separated by ',')"

    def read(self, value: object) -> tuple[str, ...]:
        out = []
        for p in _items(value, r"[,\s]+"):
            if not isinstance(p, str) or not p.strip().isidentifier():
                raise Rejected
            out.append(p.strip())
        return tuple(out)


class Uids:
    """User ids: a list of non-negative integers, or one string of them separated by commas."""

    what = "a list of user ids (non-negative integers, or one string of them separated by ',')"

    def read(self, value: object) -> tuple[int, ...]:
        out = []
        for p in _items(value, r"[,:\s]+"):
            if isinstance(p, int) and not isinstance(p, bool) and p >= 0:
                out.append(p)
            elif isinstance(p, str) and p.strip().isdigit():
                out.append(int(p))
            else:
                raise Rejected
        return tuple(out)


class SocketPath:
    """A Unix socket path (``~`` expanded, surrounding blanks dropped); empty means none given."""

    what = "a socket path"

    def read(self, value: object) -> str:
        if not isinstance(value, str | os.PathLike):
            raise Rejected
        return os.path.expanduser(str(value).strip())
