"""Per-group quantisation of a floating tensor to 8, 4 or 2 bits, and back: vectorised torch ops.

Note: [the codes] A tensor is cut, in memory order, into groups of ``g`` values (see
:func:`group_size`; the last group is padded with zeros) and each group gets its own range:

* ``int8`` symmetric: ``scale = max|x| / 127``, ``q = round(x / scale)`` in -127..127, decoded
  as ``q * scale``. The group's largest magnitude decodes to itself within one rounding of the
  float multiply, zero to exactly zero. ``int8`` affine (``symmetric=False``) and ``int4`` /
  ``int2`` (always affine, as ActNN): ``lo = min x``, ``step = (max x - lo) / (2**bits - 1)``,
  ``q = round((x - lo) / step)`` in 0..2**bits-1, decoded as ``lo + q * step``; int4 and int2
  codes are packed two and four to a byte.
* ``fp8-e4m3`` / ``fp8-e5m2``: ``scale = max|x| / F`` with ``F`` the format's largest finite
  value (448, 57344), codes are ``x / scale`` cast to torch's float8 dtype (round to nearest
  even), decoded as ``code * scale``.

Codes are clamped to the code range before the cast, so a value can never wrap around (Mesa's
kernel turns values above 255 into small ones). A group holding an infinity, a NaN or a
magnitude above ``2**126`` (a quarter of float32's largest value: beyond it a decoded value
could overflow, int8 decoding float32's ``finfo.min`` to -inf) gets NaN ranges and decodes to
NaN as a whole, and :attr:`Encoded.finite` says whether any group did; the coder then saves the
tensor exactly instead (see [non-finite values] in coder.py). A group of zeros decodes to
zeros. Stochastic rounding (``stochastic=True``, integer codes only) replaces ``round(v)`` by
``floor(v + u)`` with ``u`` uniform in [0, 1) from the generator given, so the decoded value is
unbiased: its expectation is ``x`` (up to the clamp).

Ranges are kept per group, in float32, next to the codes (``params``: one scale per group, or
``lo`` and ``step``); they cost ``4 / g`` or ``8 / g`` bytes per value.

Note: [two paths, one result] Host tensors of float32 or bfloat16 with round to nearest (every
codec's default) go through csrc/codec/codec.c (``offloadd.codec._kernels``), which reads each group
once instead of making five passes of whole-tensor ops; it computes the same float32 operations
in the same order, and casts to float8 with the same round half to even as torch's conversion,
so its codes and decoded values are bitwise those of the torch ops below (tests hold both to it,
every float8 rounding boundary included). Everything else (CUDA tensors, float16, stochastic
rounding, an install without the compiled kernels, or with kernels built from a csrc/codec/codec.c
older than its ``VERSION`` 2, whose encode does not count the groups not finite) runs as the
torch ops.

The kernels run on the calling thread. Splitting the groups over torch's thread count of
pthreads is faster alone, but inside a training step torch's OpenMP workers spin on the same
cores between ops and the extra threads fight them: one thread makes encode and decode faster per
step (docs/benchmarks/codec_step_cpu-2core_2026-11-24_fused-fp8.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Final, get_args

import torch

from offloadd.config.schema import CodecName


def _load_kernels() -> ModuleType | None:
    try:
        from offloadd.codec import _kernels
    except ImportError:  # not built (docs/native.md): the torch ops do it all
        return None
    if getattr(_kernels, "VERSION", 0) < 2:  # built from an older csrc/codec/codec.c: rebuild it
        return None
    return _kernels


_kernels = _load_kernels()
log = logging.getLogger("offloadd")

__all__ = [
    "CODECS",
    "Encoded",
    "Scheme",
    "coded_nbytes",
    "decode",
    "encode",
    "group_size",
    "native_available",
]

CODECS: Final = get_args(CodecName)
"""The codec names the config accepts; ``none`` stores activations exactly (the default)."""

_FP8: Final = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
_BITS: Final = {"int8": 8, "fp8-e4m3": 8, "fp8-e5m2": 8, "int4": 4, "int2": 2}


@dataclass(frozen=True, slots=True)
class Scheme:
    """How a codec encodes: its name, the group size asked for, symmetric int8, stochastic
    rounding. Built from the config (:class:`~offloadd.codec.Codec`)."""

    name: str
    group: int = 256
    symmetric: bool = True
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.name not in _BITS:
            raise ValueError(f"codec.name: {self.name!r} is not one of {', '.join(CODECS[1:])}")
        if self.stochastic and self.name in _FP8:
            raise ValueError(
                f"codec.stochastic: stochastic rounding is for the integer codecs, not {self.name}"
            )

    @property
    def bits(self) -> int:
        return _BITS[self.name]

    @property
    def affine(self) -> bool:
        return self.name in ("int4", "int2") or (self.name == "int8" and not self.symmetric)


@dataclass(slots=True)
class Encoded:
    """A tensor's codes (``uint8``, 1-D, packed for int4/int2) and its per-group ranges
    (``float32``: ``(groups, 1)`` scales, or ``(groups, 2)`` ``lo, step``)."""

    codes: torch.Tensor
    params: torch.Tensor
    numel: int
    group: int
    finite: bool = True
    """False when a group's range is not finite (see [the codes]): its params are NaN."""


_EDGE: Final = 2.0**126
"""The largest magnitude encoded (see [the codes]); csrc/codec/codec.c has the same."""


def group_size(shape: tuple[int, ...] | torch.Size, group: int) -> int:
    """The group for a tensor of ``shape`` (in memory order) near ``group`` values that never
    cuts across rows where it can help it.

    The last dimension ``d`` is a row (a token's features, or one attention head's slice of
    them): with ``d >= group`` the largest divisor of ``d`` not above ``group`` (if at least a
    quarter of it); with ``d < group`` whole rows, as many of the next dimension's as fit, so
    that a group of a ``(batch, heads, tokens, head_dim)`` tensor stays within one head (Mesa's
    head-wise ranges, per a few tokens). Otherwise ``group`` itself, rows or not."""
    if not shape:
        return group
    d = int(shape[-1])
    if d >= group:
        g = _largest_divisor_at_most(d, group)
    elif d > 0:
        rows = int(shape[-2]) if len(shape) >= 2 else 1
        g = d * _largest_divisor_at_most(rows, group // d)
    else:
        g = group
    return g if 4 * g >= group else group


def _largest_divisor_at_most(n: int, at_most: int) -> int:
    for k in range(min(n, at_most), 0, -1):
        if n % k == 0:
            return k
    return 1


def coded_nbytes(numel: int, scheme: Scheme, group: int) -> int:
    """Bytes of codes and ranges for ``numel`` values in groups of ``group``."""
    groups = -(-numel // group)
    per_byte = 8 // scheme.bits
    codes = -(-groups * group // per_byte)
    return codes + groups * 4 * (2 if scheme.affine else 1)


_NATIVE_DTYPES: Final = {torch.float32: 0, torch.bfloat16: 1}


def native_available() -> bool:
    """Whether the fused kernels of csrc/codec/codec.c were built (see [two paths, one result])."""
    return _kernels is not None


def _native(device: torch.device, dtype: torch.dtype, scheme: Scheme) -> bool:
    fits = device.type == "cpu" and dtype in _NATIVE_DTYPES and not scheme.stochastic
    if fits and _kernels is None:
        _warn_missing()
    return fits and _kernels is not None


_warned: list[bool] = []


def _warn_missing() -> None:
    """Once per process: the kernels would serve here, but they are not built."""
    if not _warned:
        _warned.append(True)
        log.warning(
            "offloadd: the codec's kernels (offloadd.codec._kernels) are not built or do not "
            "load: the codec runs as torch ops (the same codes, slower). Build them by "
            "reinstalling offloadd (docs/native.md)"
        )


_FP8_CODE: Final = {"fp8-e4m3": 1, "fp8-e5m2": 2}  # the kernels' format argument (0: integer)


def encode(
    x: torch.Tensor,
    scheme: Scheme,
    group: int,
    generator: torch.Generator | None = None,
    *,
    native: bool = True,
) -> Encoded:
    """Codes and ranges of the values of ``x`` (floating; contiguous), groups of ``group``;
    ``native=False`` forces the torch ops (see [two paths, one result])."""
    n = x.numel()
    if native and _native(x.device, x.dtype, scheme):
        return _encode_native(x, scheme, group)
    groups = -(-n // group)
    flat = x.reshape(-1)
    if groups * group != n:
        flat = torch.cat([flat, flat.new_zeros(groups * group - n)])
    xg = flat.view(groups, group)
    lo, hi = torch.aminmax(xg, dim=1, keepdim=True)
    lo, hi = lo.float(), hi.float()
    bad = ~((lo >= -_EDGE) & (hi <= _EDGE))  # NaN too: every comparison with it is false
    name = scheme.name
    if scheme.affine:
        top = (1 << scheme.bits) - 1
        step = (hi - lo) / top
        step = torch.where(step > 0, step, 1.0)
        v = (xg - lo) / step  # float32 (promoted), groups x group
        q = _rounded(v, 0, top, scheme.stochastic, generator).to(torch.uint8)
        params = torch.cat([lo, step], dim=1)
        codes = _packed(q.view(-1), scheme.bits)
    else:
        amax = torch.maximum(-lo, hi)
        limit = 127.0 if name == "int8" else torch.finfo(_FP8[name]).max
        scale = amax / limit
        scale = torch.where(scale > 0, scale, 1.0)
        v = xg / scale
        if name == "int8":
            q = _rounded(v, -127, 127, scheme.stochastic, generator).to(torch.int8)
        else:
            q = v.clamp_(-limit, limit).to(_FP8[name])
        params = scale
        codes = q.view(torch.uint8).view(-1)
    params = params.masked_fill(bad, float("nan"))
    finite = not bool(bad.any())  # a flag per group; on CUDA, the encoder's one sync
    return Encoded(codes=codes, params=params, numel=n, group=group, finite=finite)


def _encode_native(x: torch.Tensor, scheme: Scheme, group: int) -> Encoded:
    x = x.contiguous()  # the kernel reads memory order: the values' order (a no-op in the coder)
    n = x.numel()
    groups = -(-n // group)
    per_byte = 8 // scheme.bits
    codes = torch.empty(-(-groups * group // per_byte), dtype=torch.uint8)
    params = torch.empty(groups, 2 if scheme.affine else 1, dtype=torch.float32)
    assert _kernels is not None
    bad = _kernels.encode(
        x.data_ptr(),
        _NATIVE_DTYPES[x.dtype],
        n,
        group,
        scheme.bits,
        int(scheme.affine),
        codes.data_ptr(),
        params.data_ptr(),
        _FP8_CODE.get(scheme.name, 0),
    )  # the number of groups whose range is not finite, found by the range pass
    return Encoded(codes=codes, params=params, numel=n, group=group, finite=not bad)


def _rounded(
    v: torch.Tensor, low: int, high: int, stochastic: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """``v`` rounded (in place) to integers in ``low..high``: to nearest, or stochastically."""
    if stochastic:
        noise = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype)
        v.add_(noise).floor_()
    else:
        v.round_()
    return v.clamp_(low, high)


def _packed(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of ``bits`` bits each, ``8 // bits`` to a byte, the first in the low bits."""
    per_byte = 8 // bits
    if per_byte == 1:
        return q
    pad = -q.numel() % per_byte
    if pad:
        q = torch.cat([q, q.new_zeros(pad)])
    q = q.view(-1, per_byte)
    out = q[:, 0].clone()
    for i in range(1, per_byte):
        out |= q[:, i] << (bits * i)
    return out


def _unpacked(codes: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return codes[:count]
    mask = (1 << bits) - 1
    parts = [(codes >> (bits * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=1).view(-1)[:count]


def decode(
    enc: Encoded, scheme: Scheme, dtype: torch.dtype, *, native: bool = True
) -> torch.Tensor:
    """The ``enc.numel`` decoded values, 1-D, of ``dtype``, on the codes' device."""
    if native and _native(enc.codes.device, dtype, scheme):
        out = torch.empty(enc.numel, dtype=dtype)
        assert _kernels is not None
        _kernels.decode(
            enc.codes.data_ptr(),
            enc.params.data_ptr(),
            enc.numel,
            enc.group,
            scheme.bits,
            int(scheme.affine),
            out.data_ptr(),
            _NATIVE_DTYPES[dtype],
            _FP8_CODE.get(scheme.name, 0),
        )
        return out
    g = enc.group
    groups = enc.params.shape[0]
    if scheme.affine:
        q = _unpacked(enc.codes, scheme.bits, groups * g).view(groups, g)
        lo, step = enc.params[:, :1], enc.params[:, 1:]
        out = torch.mul(q.to(torch.float32), step).add_(lo)
    else:
        if scheme.name == "int8":
            q = enc.codes.view(torch.int8)
        else:
            q = enc.codes.view(_FP8[scheme.name])
        out = torch.mul(q.view(groups, g).to(torch.float32), enc.params)
    flat = out.view(-1)[: enc.numel]
    return flat if dtype == torch.float32 else flat.to(dtype)
