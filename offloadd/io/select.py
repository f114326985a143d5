"""Choosing the I/O engine from ``Config.engine`` and ``io_uring``, and saying why.

* ``"python"``: :class:`~offloadd.io.request.PythonEngine`, the reference implementation.
* ``"native"``: :class:`~offloadd.io.native.NativeEngine`; an error if the extension did not build.
* ``"kvikio"``: GPUDirect Storage for CUDA tensors (:mod:`offloadd.io.gds`); host memory still
  goes through native (or python). An error if kvikio or cuFile does not work.
* ``"auto"``: native where it loads, else python; kvikio for CUDA tensors where it works.

Every choice made by ``"auto"`` is logged at INFO with its reason, and recorded in
:class:`EngineChoice` so that stats and benchmarks can show it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from offloadd.config import Config
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Engine

__all__ = ["EngineChoice", "open_host_engine"]

log = logging.getLogger("offloadd")


@dataclass(frozen=True, slots=True)
class EngineChoice:
    name: str  # "native/uring", "native/threads" or "python"
    reason: str


def open_host_engine(cfg: Config) -> tuple[Engine, EngineChoice]:
    """The engine for host memory (staging slots, pinned pool) named by ``cfg``."""
    if cfg.engine == "python":
        return PythonEngine(cfg.io_threads), EngineChoice("python", "engine = python")
    from offloadd.io import native

    ok, why = native.available()
    if not ok:
        if cfg.engine == "native":
            raise RuntimeError(f"offloadd: engine = native, but {why}")
        if cfg.io_uring == "on":
            raise RuntimeError(f"offloadd: io_uring = on needs the native engine, but {why}")
        choice = EngineChoice("python", f"native engine unavailable: {why}")
        log.info("offloadd: I/O engine python (%s)", choice.reason)
        return PythonEngine(cfg.io_threads), choice
    if cfg.io_uring == "off":
        backend, reason = "threads", "io_uring = off"
    else:
        uring_ok, uring_why = native.uring_available()
        if uring_ok:
            backend, reason = "uring", "io_uring probe succeeded"
        elif cfg.io_uring == "on":
            raise RuntimeError(f"offloadd: io_uring = on, but io_uring is unavailable: {uring_why}")
        else:
            backend, reason = "threads", f"io_uring unavailable: {uring_why}"
    depth = max(8, 2 * cfg.io_threads)
    try:
        engine = native.NativeEngine(
            cfg.io_threads, chunk_bytes=cfg.chunk_bytes, backend=backend, depth=depth
        )
    except OSError as e:  # e.g. a ring of this depth refused (memlock limits on old kernels)
        if backend != "uring" or cfg.io_uring == "on":
            raise
        backend, reason = "threads", f"io_uring ring of depth {depth} refused: {e}"
        engine = native.NativeEngine(cfg.io_threads, chunk_bytes=cfg.chunk_bytes, backend=backend)
    choice = EngineChoice(f"native/{backend}", reason)
    log.info("offloadd: I/O engine %s (%s)", choice.name, choice.reason)
    return engine, choice
