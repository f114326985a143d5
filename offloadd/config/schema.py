"""The configuration: :class:`Config`, a kw-only dataclass whose ``daemon`` and ``codec`` fields
are sections.

Every field is declared once: its default and its kind (how a value is read and checked) in
``setting(...)``, its docstring below it (:mod:`offloadd.config.fields`). Its name is at once the
TOML key (``configs/*.toml``) and, upper-cased behind the ``OFFLOADD_`` prefix, the environment
variable (``min_bytes`` -> ``OFFLOADD_MIN_BYTES``); a section's keys are its table (``[daemon]``,
``[codec]``) and ``OFFLOADD_<SECTION>_<KEY>``. :meth:`Config.load` reads both
(:mod:`offloadd.config.loader`). Sizes accept plain integers or a binary/decimal suffix
(``4MiB``, ``256k``, ``1G``). A bad value raises :class:`ValueError` naming the dotted key, the
value and, when loaded, where it came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from offloadd.config.codec import CodecConfig, CodecName
from offloadd.config.daemon import DaemonConfig
from offloadd.config.fields import Settings, section, sections, setting
from offloadd.config.loader import build, flatten, load, load_section
from offloadd.config.renamed import move_renamed, reads_renamed
from offloadd.config.validators import Bool, Budget, Choice, DirectIO, Dirs, Int, Size

__all__ = [
    "CodecName",
    "Config",
    "DirectIO",
    "EngineName",
    "HostAllocator",
    "IoUring",
    "Tier",
    "load_daemon",
]

Tier = Literal["keep", "cpu", "ssd"]
EngineName = Literal["auto", "native", "python", "kvikio"]
IoUring = Literal["auto", "on", "off"]
HostAllocator = Literal["auto", "caching", "system"]
RelayMode = Literal["off", "frozen"]

_ALIGN = 4096


@reads_renamed
@dataclass(kw_only=True, slots=True, frozen=True)
class Config(Settings):
    """How the offloader treats saved activations. Every field has a default that works."""

    tier: Tier = setting("ssd", Choice(get_args(Tier)))
    """Where offloaded activations go. ``"keep"``: hooks installed, everything kept in memory (the
    accounting baseline). ``"ssd"``: written to files in ``ssd_dirs``. ``"cpu"``: CUDA tensors go to
    a pinned host pool of ``host_budget_bytes`` and spill to ``ssd_dirs`` past it; CPU tensors stay
    where they are (moving host memory to host memory saves nothing)."""

    ssd_dirs: tuple[str, ...] = setting((), Dirs())
    """Directories for the ssd tier (and the cpu tier's spill), striped chunk by chunk when several
    are given. Empty: a per-user directory on a local, non-tmpfs file system is chosen and logged."""

    min_bytes: int = setting(1 << 20, Size())
    """Tensors smaller than this are kept in memory: moving them costs more than it saves."""

    dedup: bool = setting(True, Bool())
    """Move a storage once even when several saved tensors (views, transposes, expands) share it."""

    staging_bytes: int = setting(128 << 20, Size())
    """Size of the pre-allocated, page-aligned staging pool that writes go through, and the most
    bytes of CPU tensors held while they are written in place (ssd tier); with a ``budget``, those
    are held only up to what the plan leaves of it, where that is less (at least one chunk, one
    in a profile step; see docs/budget.md). When either is full, forward waits for writes to finish (backpressure,
    counted in stats)."""

    host_budget_bytes: int = setting(2 << 30, Size())
    """cpu tier: bytes of pinned host memory to hold activations in before spilling to ssd."""

    prefetch_bytes: int = setting(128 << 20, Size())
    """Backward reads ahead, in reverse pack order, at most this many bytes beyond what is in use."""

    chunk_bytes: int = setting(4 << 20, Size(_ALIGN, multiple=_ALIGN))
    """Unit of I/O and of staging slots; a multiple of 4096. Blocks are split into chunks."""

    io_threads: int = setting(4, Int(1, 256))
    """Threads of the embedded I/O engine (requests in flight at once). A daemon's engine has its
    own, ``daemon.io_threads``."""

    direct_io: DirectIO = setting("auto", Choice(get_args(DirectIO)))
    """O_DIRECT use: ``"auto"`` tries it and falls back to buffered I/O where the file system refuses
    it (logged once, shown in stats); ``"on"`` fails instead; ``"off"`` always uses buffered I/O.
    For the embedded engine's files; a daemon's files follow ``daemon.direct_io``."""

    trim_host_bytes: int = setting(0, Size())
    """CPU activations on glibc: hand freed heap pages back to the OS (``malloc_trim``) each time
    this many bytes were moved out or back in; 0 (the default) never does. Read-backs land in
    offloadd's own recycled buffers and in-place writes free each activation as soon as it is
    written, so the heap holds only the forward window and its freed pages are reused warm;
    trimming them makes the next allocations fault in fresh pages, a trade of step time for RSS
    measured in docs/benchmarks/."""

    host_allocator: HostAllocator = setting("auto", Choice(get_args(HostAllocator)))
    """torch's CPU allocator while the Offloader is open. ``"caching"``: offloadd's host cache
    (csrc/host_allocator/, built at install: docs/native.md), which keeps freed activation blocks warm for the next allocation of
    their size and caps what it keeps at what was live, so that freed activations neither stay
    resident as heap fragments nor fault in again; an error if it was not built. ``"system"``: torch's own (glibc's heap). ``"auto"``: the host
    cache for tier ssd on a machine without CUDA, falling back to system with a warning saying why;
    system otherwise."""

    engine: EngineName = setting("auto", Choice(get_args(EngineName)))
    """I/O engine. ``"native"``: the C engine (csrc/), which never needs the GIL; ``"python"``: the
    thread-pool reference engine; ``"kvikio"``: GPUDirect Storage for CUDA tensors (host tensors
    use native); ``"auto"``: kvikio for CUDA tensors where kvikio and cuFile work, else native,
    else python, logging what it picked and why. Naming an engine that cannot load is an error."""

    io_uring: IoUring = setting("auto", Choice(get_args(IoUring)))
    """Native engine backend: ``"on"`` drives an io_uring ring (error where the kernel or a seccomp
    profile refuses it), ``"off"`` uses its pthread pool, ``"auto"`` uses io_uring where a probe
    succeeds."""

    budget: int | float | None = setting(None, Budget())
    """A budget for the step's activation peak: offloadd profiles the first step of each input
    shape, then keeps, offloads or recomputes each block of the model so that the most memory a
    step uses above what was in use when its forward began (temporaries included, as CUDA's or
    the host cache's allocator counts it; where neither does, the saved-activation bytes offloadd
    holds) fits, fastest first (see [auto] in auto/planner.py, [measured peaks] in
    auto/probe.py). A size (``"6GiB"``) or a fraction of keep's (``"0.3x"``); ``None`` (off, the
    default) offloads every saved tensor as the tier says. A budget no plan fits in raises,
    naming the smallest feasible one."""

    memsave: bool = setting(False, Bool())
    """Under ``OFFLOADD=1``: apply :func:`offloadd.memsave` to the model (the root module of the
    first forward) once, so its Conv, ConvTranspose, BatchNorm (eval), ReLU, LeakyReLU, MaxPool and
    Dropout modules save for backward only what the gradients that will be computed need (bitwise
    the same gradients; less saved where gradients flow through frozen layers). In a program,
    call ``offloadd.memsave(model)`` yourself: an :class:`~offloadd.Offloader` does not apply it."""

    relay: RelayMode = setting("off", Choice(get_args(RelayMode)))
    """``"frozen"``: under ``OFFLOADD=1``, apply :func:`offloadd.relay` to the model (the root
    module of the first forward) once: the weights of its frozen modules are written to the ssd
    tier and read back layer by layer, just before each layer runs, in forward and in backward
    (docs/relay.md). In a program, call ``offloadd.relay(model)`` yourself."""

    relay_window: int = setting(2, Int(1, 1024))
    """Relay groups (layers) held in memory at once: the one running and those read ahead."""

    codec: CodecConfig = section(CodecConfig)
    """Lossy compression of saved activations, opt-in (off by default): the ``[codec]`` table,
    ``OFFLOADD_CODEC_<KEY>`` in the environment (:class:`~offloadd.config.CodecConfig`):
    ``codec.name`` (``"none"``, ``"int8"``, ``"fp8-e4m3"``, ``"fp8-e5m2"``, ``"int4"``,
    ``"int2"``), ``codec.group``, ``codec.symmetric``, ``codec.stochastic``, ``codec.seed``,
    ``codec.min_bytes``, ``codec.ops``. The flat keys it replaces (``codec="int8"``,
    ``codec_group``, ...) are read with a DeprecationWarning until offloadd 0.3.0."""

    compile_ops: bool = setting(True, Bool())
    """A model compiled whole (``torch.compile(model)``) with inductor streams while it computes:
    its graph empties each saved activation once read and its backward reads it back before use
    (see [emptied in the graph] in runtime/graph_ops.py). Bit-identical to the model compiled
    without offloadd on every model tested, not by construction: off is the switch for one that
    is not. CPU tensors only: a CUDA region's saved tensors move when its forward returns. It
    lowers what offloadd holds, not always the process's peak: inductor's graph saves less than
    eager to begin with (docs/compose.md, the torch.compile row). Off: such a model's saved
    tensors are moved when its forward returns (exact, but every one of them is resident at
    that point)."""

    daemon: DaemonConfig = section(DaemonConfig)
    """The daemon's settings: the ``[daemon]`` table, ``OFFLOADD_DAEMON_<KEY>`` in the
    environment (:class:`~offloadd.config.DaemonConfig`). The training side reads only
    ``daemon.socket``: when it is set and the tier is ``ssd``, the ``offloadd serve`` daemon there
    does the I/O. ``offloadd serve`` reads all of it."""

    def __post_init__(self) -> None:
        Settings.__post_init__(self)
        if self.staging_bytes < self.chunk_bytes:
            raise ValueError(
                f"staging_bytes: {self.staging_bytes} does not hold one chunk "
                f"(chunk_bytes is {self.chunk_bytes})"
            )

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        base: Config | None = None,
    ) -> Config:
        """The one loader: ``base`` (default: the defaults), then a TOML file, then variables.

        The file is ``path``, else ``$OFFLOADD_CONFIG`` (none if neither is given). Its top
        level, or its ``[offload]`` table, holds the keys of this class; its ``[daemon]`` and
        ``[codec]`` tables the sections'. ``environ`` (default: ``os.environ``) overrides both
        with ``OFFLOADD_<KEY>`` and ``OFFLOADD_<SECTION>_<KEY>``; an ``OFFLOADD_*`` variable that is neither a key nor
        reserved (:data:`~offloadd.config.RESERVED_ENV`) raises, so a typo never silently runs
        with defaults. Errors name the dotted key, the value and the file or variable."""
        return load(cls, path, environ=environ, base=base)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Config:
        """The file alone, over the defaults: ``load(path, environ={})``."""
        return cls.load(path, environ={})

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, base: Config | None = None
    ) -> Config:
        """``$OFFLOADD_CONFIG``, then the ``OFFLOADD_*`` variables, over ``base``: :meth:`load`."""
        return cls.load(None, environ=environ, base=base)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str | None = None) -> Config:
        """Build from ``{key: value}`` as a TOML file holds them (a section: a table, or an
        instance of its class), converting strings; errors name ``source`` when given."""
        return build(cls, flatten(cls, values, source))

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied and checked. A section (``daemon``, ``codec``) may be
        an instance of its class (the whole section) or a mapping of some of its keys, merged
        into the current section: ``cfg.replace(daemon={"socket": path})``. Renamed keys are
        read with a warning (see [renamed keys] in config/renamed.py)."""
        changes = move_renamed(Config, changes, "a keyword argument", "keyword")
        values = self.as_dict()
        for name in sections(Config):
            given = changes.get(name)
            if isinstance(given, Mapping):
                changes[name] = {**values[name], **given}
        return self.from_mapping({**values, **changes})


def load_daemon(
    path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None
) -> DaemonConfig:
    """The daemon's section as ``offloadd serve``, ``status`` and ``stop`` read it: the
    ``[daemon]`` table of ``path`` (a file of daemon keys alone is read as that table), then the
    ``OFFLOADD_DAEMON_*`` variables of ``environ`` (default: ``os.environ``) and no others
    (:func:`offloadd.config.loader.load_section`)."""
    daemon: DaemonConfig = load_section(Config, "daemon", path, environ=environ)
    return daemon
