"""Opt-in lossy compression of saved activations (Mesa / ActNN style): the ``[codec]`` section,
``Config.codec``.

``quant`` encodes and decodes (per-group int8, fp8, int4, int2), ``ops`` decides what may be
encoded, ``coder`` puts both in the pack path of an :class:`~offloadd.Offloader`.
"""

from offloadd.codec.coder import Codec, Coded
from offloadd.codec.ops import DEFAULT_OPS, OpScope
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
