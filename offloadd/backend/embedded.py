"""The default backend: offload files and an I/O engine inside the training process."""

from __future__ import annotations

import logging
import threading

from offloadd.config import Config
from offloadd.io.buffers import SlotPool
from offloadd.io.engine_choice import choose_device_engine, open_host_engine, wants_gds
from offloadd.io.files import DiskStore, default_offload_dir
from offloadd.io.hugepages import advise_huge_pages
from offloadd.io.request import Engine, Request

__all__ = ["EmbeddedBackend"]

log = logging.getLogger("offloadd")


class EmbeddedBackend:
    """:class:`~offloadd.backend.base.Backend` over a :class:`DiskStore` and a host engine
    (``engine``, or the one ``config`` names), plus GDS for CUDA tensors where it works."""

    def __init__(self, config: Config, engine: Engine | None = None) -> None:
        self._config = config
        self._dirs = dirs = list(config.ssd_dirs) or [default_offload_dir()]
        self._disk = DiskStore(dirs, config.chunk_bytes, config.direct_io)
        try:
            if engine is not None:
                self._engine = engine
                self._name = getattr(engine, "name", type(engine).__name__)
            else:
                self._engine, choice = open_host_engine(config)
                self._name = choice.name
        except BaseException:
            self._disk.close()
            raise
        self._engines: list[Engine] = [self._engine]
        self._staging: SlotPool | None = None
        self._lock = threading.Lock()
        self._gds: Engine | None = None
        self._gds_checked = not wants_gds(config)
        if config.engine == "kvikio" and config.tier == "ssd":
            self.open_direct()  # named explicitly: fail now, not at the first CUDA tensor

    @property
    def name(self) -> str:
        name = self._name
        if name == "native/uring":  # the native engine moves to its threads if its ring fails
            name = f"native/{getattr(self._engine, 'backend', 'uring')}"
        return name + ("+kvikio" if self._gds is not None else "")

    @property
    def buffered(self) -> bool:
        return self._disk.buffered

    def stall_hint(self) -> str:
        return f"the embedded {self.name} engine, to {', '.join(self._dirs)}"

    @property
    def used_bytes(self) -> int:
        return self._disk.used_bytes

    @property
    def writes_pages(self) -> bool:
        return bool(getattr(self._engine, "writes_pages", False))

    def staging(self) -> SlotPool:
        with self._lock:
            if self._staging is None:
                pool = SlotPool(self._config.staging_bytes, self._config.chunk_bytes)
                # every write leaves from here: huge pages halve its cost ([huge-page buffers])
                huge = advise_huge_pages(pool.address(0), pool.num_slots * pool.slot_bytes)
                log.info("offloadd: staging slots %s huge pages", "on" if huge else "without")
                self._staging = pool
            return self._staging

    def place(self, hint: int) -> tuple[int, int]:
        file = hint % len(self._disk.files)
        return file, self._disk.files[file].alloc()

    def free(self, file: int, offset: int) -> None:
        self._disk.files[file].free(offset)

    def target(self, file: int) -> tuple[int, str]:
        f = self._disk.files[file]
        return f.fd, f.path

    def submit(self, request: Request, *, direct: bool = False) -> None:
        engine = self._gds if direct else self._engine
        assert engine is not None, "direct I/O without GDS"
        engine.submit(request)

    def cancel(self, request: Request) -> bool:
        return self._engine.cancel(request)

    def open_direct(self) -> bool:
        """Probe GDS (kvikio and cuFile) once; log the outcome, raise if it was asked for."""
        if self._gds_checked:
            return self._gds is not None
        from offloadd.io import gds

        with self._lock:
            if self._gds_checked:
                return self._gds is not None
            self._gds_checked = True  # whatever happens below: probe once
            choice = choose_device_engine(self._config)  # raises for engine = kvikio without GDS
            ok, why = choice.name == "kvikio", choice.reason
            if ok:
                try:
                    self._gds = gds.KvikioEngine(self._config.io_threads)
                except Exception as e:
                    ok, why = False, f"kvikio engine failed to start ({e!r})"
            if not ok and self._config.engine == "kvikio":
                raise RuntimeError(f"offloadd: engine = kvikio, but {why}")
            if self._gds is not None:
                self._engines.append(self._gds)
            log.info(
                "offloadd: CUDA tensors %s (%s)",
                "use GDS" if ok else "go through host staging",
                why,
            )
            return self._gds is not None

    def begin_step(self) -> None:
        pass

    def close(self) -> None:
        for engine in self._engines:
            engine.close()

    def release(self) -> None:
        self._disk.close()
