"""Type stub for the C extension built from csrc/codec/codec.c (offloadd/codec/quant.py calls it).

Addresses are a contiguous tensor's ``data_ptr()``; dtype 0 is float32, 1 bfloat16; fp8 0 for
integer codes, 1 for float8 e4m3fn, 2 for e5m2 (the comment at the top of codec.c says more)."""

VERSION: int
"""2: encode returns the groups whose range is not finite."""

def encode(
    src: int,
    dtype: int,
    n: int,
    group: int,
    bits: int,
    affine: int,
    codes: int,
    params: int,
    fp8: int,
    /,
) -> int:
    """Quantise ``n`` values of ``src`` per group into ``codes`` and ``params``; returns how many
    groups hold a value that is not finite (their params are NaN)."""

def decode(
    codes: int,
    params: int,
    n: int,
    group: int,
    bits: int,
    affine: int,
    dst: int,
    dtype: int,
    fp8: int,
    /,
) -> None:
    """The ``n`` values of ``codes`` and ``params``, into ``dst``."""
