"""Opt-in lossy compression of saved activations (Mesa / ActNN style): the ``[codec]`` section,
``Config.codec``.

``quant`` encodes and decodes (per-group int8, fp8, int4, int2), ``allowlist`` decides what may be
encoded, ``coder`` puts both in the pack path of an :class:`~offloadd.Offloader`.
"""

from offloadd.codec.allowlist import DEFAULT_OPS, OpScope
from offloadd.codec.coder import Codec, Coded
from offloadd.codec.quant import CODECS, Encoded, Scheme, coded_nbytes, decode, encode, group_size

__all__ = [
    "CODECS",
    "DEFAULT_OPS",
    "Codec",
    "Coded",
    "Encoded",
    "OpScope",
    "Scheme",
    "coded_nbytes",
    "decode",
    "encode",
    "group_size",
]
