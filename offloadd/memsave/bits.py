"""Bit masks: a bool tensor packed eight elements to a byte, and back.

Shared by the ReLU, LeakyReLU and Dropout functions (:mod:`offloadd.memsave.pointwise`), whose
backward needs one bit per element where PyTorch saves a full tensor or a byte mask. Packing and
unpacking are a few vectorised torch ops on the whole tensor, never a Python loop over elements.

Note: [packing]
~~~~~~~~~~~~~~~
The mask's bytes (0 or 1) are read eight at a time as one int64 (little endian: element ``i`` of
a group at bit ``8 i``) and multiplied by ``0x0102040810204080``, which moves bit ``8 i`` to bit
``56 + i``; the 64 partial products land on distinct bit positions, so nothing carries into the
top byte, and ``>> 56 & 0xFF`` is the packed byte (element ``i`` at bit ``i``). Unpacking
multiplies each byte by ``0x0101010101010101`` (eight copies, one per byte of an int64, no
carries), keeps bit ``i`` of byte ``i`` (``& 0x8040201008040201``) and reads the bytes as
``!= 0``. The int64 view needs the padded mask's length to be a
multiple of 8 (it is padded with zeros) and the byte order of the host to be little endian
(checked at import; a big-endian host takes the shift-and-sum path).
"""

from __future__ import annotations

import math
import sys

import torch

__all__ = ["pack_bits", "packed_bytes", "unpack_bits", "unpack_flags"]

_MAGIC = 0x0102040810204080
_SPREAD = 0x0101010101010101
_SELECT = 0x8040201008040201 - (1 << 64)  # as a signed int64
_LITTLE = sys.byteorder == "little"


def packed_bytes(numel: int) -> int:
    """Bytes :func:`pack_bits` returns for a mask of ``numel`` elements."""
    return (numel + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as a flat uint8 tensor of ``ceil(numel / 8)`` bytes (element ``8 j + i`` at bit
    ``i`` of byte ``j``). The shape is not kept: pass it to :func:`unpack_bits`."""
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_bits takes a bool tensor, not {mask.dtype}")
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    u8 = flat.contiguous().view(torch.uint8)
    if _LITTLE and u8.numel():
        groups = u8.view(torch.int64)
        return ((groups * _MAGIC) >> 56).to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (u8.view(-1, 8) << shifts).sum(-1, dtype=torch.uint8)


def unpack_flags(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A uint8 tensor of ``shape``: 0 where the bit :func:`pack_bits` packed is clear, nonzero (not
    always 1) where it is set. One pass fewer than :func:`unpack_bits`, for consumers that only
    compare with 0 (``threshold_backward``, ``leaky_relu_backward``)."""
    numel = math.prod(shape)
    if _LITTLE:
        spread = packed.to(torch.int64).mul_(_SPREAD).bitwise_and_(_SELECT)
        flags = spread.view(torch.uint8)
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        flags = (packed.unsqueeze(-1) >> shifts) & 1
    return flags.reshape(-1)[:numel].view(shape)


def unpack_bits(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The bool tensor of ``shape`` that :func:`pack_bits` packed into ``packed``."""
    return unpack_flags(packed, shape).bool()  # a cast: vectorised, unlike != 0
