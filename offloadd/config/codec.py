"""The codec's settings: the ``codec`` section of :class:`~offloadd.config.Config`.

In TOML they are the ``[codec]`` table; in the environment ``OFFLOADD_CODEC_<KEY>``
(``OFFLOADD_CODEC_NAME=int8``); in Python ``Offloader(codec={"name": "int8"})`` or
``Config(codec=CodecConfig(name="int8"))``. Errors name the dotted key (``codec.group``). They were
flat keys of the top level before (``codec``, ``codec_group``, ...); those names are still read,
with a DeprecationWarning, until offloadd 0.3.0 (see [renamed keys] in config/renamed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from offloadd.config.fields import Settings, setting
from offloadd.config.validators import Bool, Choice, Int, Names, Size

__all__ = ["CodecConfig", "CodecName"]

CodecName = Literal["none", "int8", "fp8-e4m3", "fp8-e5m2", "int4", "int2"]


@dataclass(kw_only=True, slots=True, frozen=True)
class CodecConfig(Settings):
    """Lossy compression of saved activations, opt-in: off (``name="none"``) by default."""

    section: ClassVar[str] = "codec"

    name: CodecName = setting("none", Choice(get_args(CodecName)))
    """``"none"`` (the default) stores saved activations exactly; ``"int8"``, ``"fp8-e4m3"``,
    ``"fp8-e5m2"``, ``"int4"``, ``"int2"`` encode the floating activations that the ops in
    ``ops`` save, per group of ``group`` values with a range each, before they are kept, moved
    or written (see [the codes] in codec/quant.py, [what gets compressed] in codec/allowlist.py).
    Gradients are then approximate: docs/benchmarks holds the measured error and loss curves of
    each codec."""

    group: int = setting(256, Int(8, 1 << 20))
    """Values per quantisation group (a range each); near it, groups follow rows and heads."""

    symmetric: bool = setting(True, Bool())
    """``int8``: a scale per group around zero (``True``) or a minimum and a step (``False``).
    int4 and int2 always use a minimum and a step; fp8 always a scale."""

    stochastic: bool = setting(False, Bool())
    """Integer codecs: round stochastically (unbiased) instead of to nearest, from a generator
    seeded per step with ``seed``, so runs reproduce."""

    seed: int = setting(0, Int(0, (1 << 63) - 1))
    """Seed of stochastic rounding (mixed with the step number)."""

    min_bytes: int = setting(64 << 10, Size())
    """Floating activations smaller than this are never encoded."""

    ops: tuple[str, ...] = setting((), Names())
    """Torch functions whose saved activations the codec may encode (``["linear"]``: only linear
    inputs); empty (the default): the list in codec/allowlist.py, each entry with its reason."""

    def __post_init__(self) -> None:
        Settings.__post_init__(self)
        if self.stochastic and self.name.startswith("fp8"):
            raise ValueError(
                f"codec.stochastic: stochastic rounding is for the integer codecs, not {self.name}"
            )
