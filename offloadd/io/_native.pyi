"""Type stub for the C extension built from csrc/io_native/ (module.c is its binding)."""

HAVE_URING: int
ALIGN: int

def probe_uring() -> tuple[bool, str]:
    """Whether io_uring works in this process, and why not."""

# Test hooks: fault injection and a gate on bounce-buffer copies. Not for production use.
def _inject_fault(name: str, count: int, errno: int, /) -> None:
    """The next ``count`` passes through fault point ``name`` ("uring_enter", "alloc",
    "completion") fail with ``errno`` instead of making the call (every pass if ``count`` < 0);
    ``count`` 0 disarms it."""

def _hold_copies(on: bool, /) -> None:
    """While on, every bounce-buffer copy waits (at most 5 s) before it starts."""

def _held_copies() -> int:
    """How many bounce-buffer copies are waiting in ``_hold_copies`` now."""

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
