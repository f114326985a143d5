"""Type stub for the C extension built from csrc/io_native/ (module.c is its binding).

The fault hooks (``_inject_fault``, ``_hold_copies``, ``_held_copies``) are only in the tests'
build of these sources (tests/io/native_build.py), not in this module."""

HAVE_URING: int
ALIGN: int

def copy(dst: int, src: int, nbytes: int, /) -> None:
    """Copy ``nbytes`` from address ``src`` to address ``dst`` (memmove; the GIL released from
    1 MiB)."""

def probe_uring() -> tuple[bool, str]:
    """Whether io_uring works in this process, and why not."""

class Engine:
    """Native I/O engine: a pthread pool or one io_uring ring; completions via an eventfd."""

    @property
    def backend(self) -> str:
        """'threads' or 'uring'; 'threads' for good once the ring has failed."""
    @property
    def fallback(self) -> str | None:
        """None, or why the io_uring backend moved to threads (io_uring_enter's error)."""
    def __init__(
        self,
        *,
        threads: int = 4,
        chunk_bytes: int = 1048576,
        backend: str = "threads",
        depth: int = 32,
    ) -> None: ...
    def submit(
        self,
        token: int,
        op: int,
        fd: int,
        offset: int,
        address: int,
        nbytes: int,
        head: int = 0,
        tail: int = 0,
        /,
    ) -> None:
        """Queue one transfer (op 0 = read, 1 = write); raises OSError if the file cannot take it.

        A write's first (last) 4096 bytes come from ``head`` (``tail``) when it is not 0."""
    def cancel(self, token: int, /) -> bool:
        """Drop a request none of whose chunks has started; True if it will never complete."""
    def reap(self, timeout: float = -1.0) -> list[tuple[int, int, int]]:
        """Wait (GIL released) for finished requests: [(token, errno or 0, bytes moved)].

        On MemoryError the finished requests stay queued for the next call."""
    def close(self) -> None:
        """Finish every submitted request, then stop the backend threads."""
    def fileno(self) -> int:
        """An eventfd, readable while completions are waiting."""
    def counters(self) -> dict[str, int]:
        """bytes_read, bytes_written, pending."""
