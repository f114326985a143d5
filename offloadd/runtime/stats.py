"""What the offloader did: counts and bytes, as one plain dataclass."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from offloadd.units import format_bytes

__all__ = ["Stats"]


@dataclass(kw_only=True, slots=True)
class Stats:
    """A snapshot of an :class:`~offloadd.Offloader`'s counters (cumulative unless noted)."""

    saved_tensors: int = 0
    """Tensors autograd handed to the pack hook."""
    saved_bytes: int = 0
    """Their bytes (``numel * element_size``, views counted in full each time)."""
    offloaded_bytes: int = 0
    """Bytes of storages moved out of process memory (each shared storage once)."""
    deduplicated_bytes: int = 0
    """Bytes of saved tensors whose storage was already being moved (not moved again)."""
    kept_bytes: int = 0
    """Bytes of saved tensors kept in memory: small, parameters, unsupported, tier keep, fallbacks."""
    resident_bytes: int = 0
    """Now: bytes of saved activations held in process memory (kept, staging, read-back);
    saved tensors that are parameters or views of one are not activations and not counted."""
    peak_resident_bytes: int = 0
    """Most ``resident_bytes`` held at once."""
    buffer_bytes: int = 0
    """Now: bytes of offloadd's own buffers, in use or idle: staging slots, the cpu tier's host
    pool, the read-back pool (buffers lent to autograd included) and bounce pages. Not part of
    ``resident_bytes``: add both for the memory offloadd holds, but for read-backs held by
    autograd in the host cache's blocks (see [one pool] in io/pools.py)."""
    peak_buffer_bytes: int = 0
    """Most ``buffer_bytes`` at once."""
    host_allocator: str = ""
    """torch's CPU allocator while this Offloader is open: "caching" (offloadd's host cache, see
    ``Config.host_allocator``) or "system"."""
    host_cached_bytes: int = 0
    """Now: bytes of freed blocks the host cache keeps mapped for reuse (process-wide; 0 without
    it). Memory offloadd holds, on top of ``resident_bytes`` and ``buffer_bytes``."""
    host_cache_hits: int = 0
    """Allocations the host cache served from a freed block (process-wide)."""
    host_cache_misses: int = 0
    """Allocations it mapped fresh (process-wide)."""
    bytes_written: int = 0
    """Bytes written to storage (padded to 4096)."""
    bytes_read: int = 0
    """Bytes read back from storage (padded to 4096)."""
    forwarded_bytes: int = 0
    """Bytes that backward took from staging before their write finished (never read back)."""
    prefetched_bytes: int = 0
    """Bytes read ahead of use by the backward prefetcher."""
    disk_bytes: int = 0
    """Now: bytes of storage space allocated in the offload files."""
    peak_disk_bytes: int = 0
    """Most ``disk_bytes`` at once."""
    io_wait_s: float = 0.0
    """Seconds the training thread waited on I/O (reads on demand, full staging pool):
    ``read_wait_s + write_wait_s``."""
    read_wait_s: float = 0.0
    """Of ``io_wait_s``: seconds backward waited for read-backs (on demand or not yet done)."""
    write_wait_s: float = 0.0
    """Of ``io_wait_s``: seconds forward waited for writes (``staging_bytes`` in flight)."""
    pack_s: float = 0.0
    """Seconds the training threads spent packing tensors that may move and capturing them
    (the staging copies and write submissions, ``write_wait_s`` included; small and kept
    tensors, microseconds each, are not timed): what offloading adds to forward on the thread
    that computes. Added without the lock, so approximate when several threads pack at once."""
    unpack_s: float = 0.0
    """Seconds spent unpacking offloaded tensors (``read_wait_s`` included): what it adds to
    backward."""
    backpressure_waits: int = 0
    """Times forward waited because the staging pool was full."""
    on_demand_reads: int = 0
    """Unpacks whose data was neither prefetched nor in staging."""
    fallbacks: int = 0
    """Tensors kept in memory because their I/O failed (disk full, I/O error)."""
    buffered_io: bool = False
    """True when some file fell back from O_DIRECT to buffered I/O."""
    codec: str = ""
    """The lossy codec in use (``Config.codec.name``; empty for none)."""
    coded_tensors: int = 0
    """Saved tensors the codec encoded (each shared view once)."""
    coded_in_bytes: int = 0
    """Their bytes before encoding."""
    coded_out_bytes: int = 0
    """The bytes of their codes and ranges (what was saved in their place)."""
    engine: str = ""
    """The I/O engine in use ("native/uring", "native/threads", "python", "daemon"; empty for
    tier keep). "native/threads" too once a failed io_uring ring moved the engine to threads."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for logs: what was saved and what it cost, totals over every step (since the
        Offloader opened or its stats were reset) apart from the peaks at any one time."""
        totals = (
            f"totals: saved {self.saved_tensors} tensors ({format_bytes(self.saved_bytes)}), "
            f"offloaded {format_bytes(self.offloaded_bytes)}, "
            f"dedup {format_bytes(self.deduplicated_bytes)}, kept {format_bytes(self.kept_bytes)}, "
            f"written {format_bytes(self.bytes_written)}, read {format_bytes(self.bytes_read)}, "
            f"io wait {self.io_wait_s:.3f}s, fallbacks {self.fallbacks}"
            + (
                f", codec {self.codec} {format_bytes(self.coded_in_bytes)} -> "
                f"{format_bytes(self.coded_out_bytes)}"
                if self.codec
                else ""
            )
            + (
                f", host cache {self.host_cache_hits}/"
                f"{self.host_cache_hits + self.host_cache_misses} hits"
                if self.host_allocator == "caching"
                else ""
            )
        )
        peaks = (
            f"peaks: resident {format_bytes(self.peak_resident_bytes)}, "
            f"buffers {format_bytes(self.peak_buffer_bytes)}, "
            f"disk {format_bytes(self.peak_disk_bytes)}"
            + (
                f" (host cache now {format_bytes(self.host_cached_bytes)} idle)"
                if self.host_allocator == "caching"
                else ""
            )
        )
        return f"{totals}; {peaks}" + (f"; engine {self.engine}" if self.engine else "")
