"""A config key declared once: one dataclass field holds its default, its kind and its docstring.

Every field of :class:`~offloadd.config.Config` and of its sections is written
``name: type = setting(default, Kind(...))`` (or ``section(Class)`` for a section), with its
docstring below it. The kind (:mod:`offloadd.config.validators`) sits in the field's metadata
under :data:`KIND`; construction (:class:`Settings`), the loader and the renamed keys all read
it from there, so no second table of keys exists to fall out of step with the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, field, fields
from typing import Any, ClassVar, Self

from offloadd.config.validators import Kind, Rejected, check

__all__ = ["KIND", "Section", "Settings", "keys", "kind_of", "section", "sections", "setting"]

KIND = "kind"
"""The metadata key of a field's kind."""


def setting(default: Any, kind: Kind) -> Any:
    """A field with ``default``, read and checked by ``kind``."""
    return field(default=default, metadata={KIND: kind})


def section(cls: type[Settings]) -> Any:
    """A field holding a section (a :class:`Settings` class of its own), defaults throughout."""
    return field(default_factory=cls, metadata={KIND: Section(cls)})


def kind_of(f: Field[Any]) -> Kind:
    """The kind of a field; a field declared without one is a programming error."""
    try:
        kind: Kind = f.metadata[KIND]
    except KeyError:
        raise TypeError(f"config field {f.name!r} has no kind: declare it with setting()") from None
    return kind


class Section:
    """The kind of a section's field: an instance of its class, or a mapping of its keys (read
    into one, each key checked under its dotted name)."""

    def __init__(self, cls: type[Settings]) -> None:
        self.cls = cls
        self.what = f"a {cls.__name__} or a table of its keys"

    def read(self, value: object) -> Settings:
        if isinstance(value, self.cls):
            return value
        if not isinstance(value, Mapping):
            raise Rejected
        names = {f.name for f in fields(self.cls)}
        if not all(isinstance(k, str) and k in names for k in value):
            raise Rejected
        return self.cls(**value)


def keys(cls: type[Settings]) -> dict[str, Kind]:
    """``{name: kind}`` of the fields of ``cls`` that are values, not sections."""
    return {f.name: kind_of(f) for f in fields(cls) if not isinstance(kind_of(f), Section)}


def sections(cls: type[Settings]) -> dict[str, type[Settings]]:
    """``{name: class}`` of the fields of ``cls`` that are sections."""
    out: dict[str, type[Settings]] = {}
    for f in fields(cls):
        kind = kind_of(f)
        if isinstance(kind, Section):
            out[f.name] = kind.cls
    return out


class Settings:
    """The base of the config dataclasses: construction reads every field by its kind.

    A section's class sets :attr:`section` to its name, the prefix of its dotted keys in errors
    (``daemon.quota_bytes``)."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # set by @dataclass on each subclass

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        prefix = f"{self.section}." if self.section else ""
        for f in fields(self):
            value = check(prefix + f.name, kind_of(f), getattr(self, f.name))
            object.__setattr__(self, f.name, value)

    def as_dict(self) -> dict[str, Any]:
        """``{key: value}`` as a TOML file would hold them, a section as a nested dict."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.as_dict() if isinstance(value, Settings) else value
        return out

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied and checked."""
        return type(self)(**{**self.as_dict(), **changes})
