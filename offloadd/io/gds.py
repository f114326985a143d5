"""GPUDirect Storage through kvikio: CUDA tensors written to and read from files directly.

With GDS, a CUDA activation goes from device memory to the offload file with no host staging
copy, and comes back into a fresh device buffer. The engine is the reference thread pool of
:class:`~offloadd.io.request.PythonEngine` with its transfer replaced by ``kvikio.CuFile.pwrite`` /
``pread``; kvikio runs the transfer in its own thread pool with the GIL released.

Requests for this engine carry the device memory as ``request.keepalive``: a contiguous uint8
CUDA tensor of exactly ``request.nbytes`` bytes at ``request.address``. Writes are ordered after
the producer by the request's ``before`` hook (a CUDA event recorded at pack).

kvikio is imported lazily: kvikio 26.x needs libcuda.so.1 even for host buffers, so nothing
here runs on a machine without a GPU. Offload files have no name (O_TMPFILE); kvikio opens
files by path, so each is reopened through ``/proc/self/fd/N``.

Not verified on a GPU yet (see docs/how-it-works.md, "Verified on a GPU, and not yet").
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import Any

import torch

from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Op, Request

__all__ = ["KvikioEngine", "install_hint", "probe"]

log = logging.getLogger("offloadd")


def install_hint() -> str:
    """The pip command for the kvikio that matches torch's CUDA: kvikio's wheels are built per
    CUDA major version (``kvikio-cu12``, ``kvikio-cu13``: an extra each; any other major, its
    own package)."""
    major = (torch.version.cuda or "12").split(".")[0]
    extra = {"12": "gds", "13": "gds-cu13"}.get(major)
    return f"pip install 'offloadd[{extra}]'" if extra else f"pip install kvikio-cu{major}"


def probe() -> tuple[bool, str]:
    """(True, why) when kvikio imports, a CUDA device exists and cuFile reports GDS available."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        import kvikio
        import kvikio.cufile_driver
    except Exception as e:  # ImportError, or OSError for a missing libcuda/libcufile
        return False, f"kvikio does not import ({e!r}); {install_hint()}"
    try:
        gds = bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception as e:
        return False, f"cuFile driver query failed ({e!r})"
    if not gds:
        return False, "kvikio imports, but cuFile reports GDS unavailable (kvikio would use POSIX)"
    return True, "kvikio imports and cuFile reports GDS available"


class KvikioEngine(PythonEngine):
    """GDS transfers between CUDA tensors and the offload files."""

    name = "kvikio"
    writes_pages = False  # device memory only (GDS requests never carry pages)

    def __init__(self, num_threads: int = 4) -> None:
        import kvikio

        self._kvikio: Any = kvikio
        self._files: dict[int, Any] = {}  # our fd -> kvikio.CuFile on /proc/self/fd/N
        self._files_lock = threading.Lock()
        super().__init__(num_threads)

    def _cufile(self, fd: int) -> Any:
        with self._files_lock:
            f = self._files.get(fd)
            if f is None:
                f = self._files[fd] = self._kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")
            return f

    def transfer(self, request: Request) -> None:
        buf = request.keepalive
        if not (
            isinstance(buf, torch.Tensor)
            and buf.is_cuda
            and buf.dtype == torch.uint8
            and buf.is_contiguous()
            and buf.numel() == request.nbytes
        ):
            raise ValueError("kvikio requests carry their device memory as a uint8 CUDA tensor")
        f = self._cufile(request.fd)
        if request.op is Op.WRITE:
            n = f.pwrite(buf, request.nbytes, request.offset).get()
        else:
            n = f.pread(buf, request.nbytes, request.offset).get()
        if n != request.nbytes:
            what = "write" if request.op is Op.WRITE else "read"
            raise OSError(
                errno.EIO,
                f"short GDS {what}: {n} of {request.nbytes} bytes at offset {request.offset}",
                request.path,
            )

    def close(self) -> None:
        super().close()
        with self._files_lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
