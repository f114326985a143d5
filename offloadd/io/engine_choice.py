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

__all__ = [
    "EngineChoice",
    "choose_device_engine",
    "choose_host_engine",
    "open_host_engine",
    "wants_gds",
]

log = logging.getLogger("offloadd")


@dataclass(frozen=True, slots=True)
class EngineChoice:
    name: str  # "native/uring", "native/threads" or "python"; for CUDA tensors "kvikio" or "host"
    reason: str


def choose_host_engine(cfg: Config) -> EngineChoice:
    """The engine :func:`open_host_engine` opens for ``cfg``, and why, without opening it: the
    native extension imported and io_uring probed, nothing else. RuntimeError where ``cfg`` names
    what cannot load. (Opening may still move a refused io_uring ring to threads.)"""
    if cfg.engine == "python":
        return EngineChoice("python", "engine = python")
    from offloadd.io import native

    ok, why = native.available()
    if not ok:
        if cfg.engine == "native":
            raise RuntimeError(f"offloadd: engine = native, but {why}")
        if cfg.io_uring == "on":
            raise RuntimeError(f"offloadd: io_uring = on needs the native engine, but {why}")
        return EngineChoice("python", f"native engine unavailable: {why}")
    if cfg.io_uring == "off":
        return EngineChoice("native/threads", "io_uring = off")
    uring_ok, uring_why = native.uring_available()
    if uring_ok:
        return EngineChoice("native/uring", "io_uring probe succeeded")
    if cfg.io_uring == "on":
        raise RuntimeError(f"offloadd: io_uring = on, but io_uring is unavailable: {uring_why}")
    return EngineChoice("native/threads", f"io_uring unavailable: {uring_why}")


def open_host_engine(cfg: Config) -> tuple[Engine, EngineChoice]:
    """The engine for host memory (staging slots, pinned pool) named by ``cfg``."""
    choice = choose_host_engine(cfg)
    if choice.name == "python":
        if cfg.engine != "python":  # the native engine is missing: docs/native.md
            log.warning("offloadd: I/O engine python (%s)", choice.reason)
        return PythonEngine(cfg.io_threads), choice
    from offloadd.io import native

    backend = choice.name.removeprefix("native/")
    depth = max(8, 2 * cfg.io_threads)
    try:
        engine = native.NativeEngine(
            cfg.io_threads, chunk_bytes=cfg.chunk_bytes, backend=backend, depth=depth
        )
    except OSError as e:  # e.g. a ring of this depth refused (memlock limits on old kernels)
        if backend != "uring" or cfg.io_uring == "on":
            raise
        backend = "threads"
        choice = EngineChoice("native/threads", f"io_uring ring of depth {depth} refused: {e}")
        engine = native.NativeEngine(cfg.io_threads, chunk_bytes=cfg.chunk_bytes, backend=backend)
    log.info("offloadd: I/O engine %s (%s)", choice.name, choice.reason)
    return engine, choice


def wants_gds(cfg: Config) -> bool:
    """Whether CUDA tensors are offered to GDS at all: ``engine`` auto or kvikio, tier ssd."""
    return cfg.engine in ("auto", "kvikio") and cfg.tier == "ssd"


def choose_device_engine(cfg: Config) -> EngineChoice:
    """How CUDA tensors reach the offload files, and why: ``"kvikio"`` (GDS) where
    :func:`offloadd.io.gds.probe` succeeds and ``cfg`` asks for it, else ``"host"`` (through the
    staging slots and the host engine). RuntimeError for ``engine = kvikio`` when GDS does not
    work. Probes only: no engine is started."""
    if not wants_gds(cfg):
        what = f"engine = {cfg.engine}" if cfg.tier == "ssd" else f"tier = {cfg.tier}"
        return EngineChoice("host", f"{what}: GDS not used")
    from offloadd.io import gds

    ok, why = gds.probe()
    if ok:
        return EngineChoice("kvikio", why)
    if cfg.engine == "kvikio":
        raise RuntimeError(f"offloadd: engine = kvikio, but {why}")
    return EngineChoice("host", why)
