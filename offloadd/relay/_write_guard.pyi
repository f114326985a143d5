"""Type stub for the C extension built from csrc/write_guard/guard.c."""

SLOTS: int

def protect(address: int, nbytes: int, /) -> int:
    """Make whole pages read-only, noting the first write into them; the slot that holds them."""

def fault(slot: int, /) -> int:
    """The first address written since ``protect``, 0 if none."""

def release(slot: int, /) -> int:
    """Make the pages writable again, free the slot; ``fault(slot)`` as it was."""

def rechain() -> None:
    """Put the guard's SIGSEGV handler back on top of any installed since (a system call)."""
