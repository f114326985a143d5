"""Per-chunk checksums: computed by the daemon on write, verified on read (and by the client when
it reads its files itself after the daemon died). xxh3 is the xxhash package's (a dependency of
offloadd); crc32 is zlib's."""

from __future__ import annotations

import zlib
from collections.abc import Callable

__all__ = ["checksum_function"]


def checksum_function(kind: str) -> Callable[[memoryview], int] | None:
    """The checksum of a buffer for ``kind`` (``xxh3``, ``crc32``), or None for ``none``."""
    if kind == "none":
        return None
    if kind == "crc32":
        return zlib.crc32
    if kind == "xxh3":
        try:
            import xxhash
        except ImportError:
            raise ValueError(
                "checksum = 'xxh3' needs the xxhash package, a dependency of offloadd that is "
                "missing here: pip install xxhash (or set checksum = 'crc32')"
            ) from None
        fn: Callable[[memoryview], int] = xxhash.xxh3_64_intdigest
        return fn
    raise ValueError(f"checksum must be one of xxh3, crc32, none; got {kind!r}")
