"""Type stub for the torch extension built from csrc/host_allocator/ (offloadd's host cache).

The module itself is empty: importing it registers the torch ops that
:class:`offloadd.runtime.host_allocator.HostCache` calls::

    torch.ops.offloadd_host_cache.configure(min_bytes: int, floor_bytes: int, slack: float,
                                            huge_pages: bool) -> None
    torch.ops.offloadd_host_cache.install() -> bool      # torch's CPU allocator now
    torch.ops.offloadd_host_cache.uninstall() -> None    # the previous one again
    torch.ops.offloadd_host_cache.installed() -> bool
    torch.ops.offloadd_host_cache.counters() -> list[int]  # HostCacheCounters' nine fields
    torch.ops.offloadd_host_cache.empty() -> int         # cached bytes unmapped
    torch.ops.offloadd_host_cache.reset_window() -> int  # live bytes now
"""
