"""The configuration: :class:`Config`, a kw-only dataclass whose ``daemon`` field is a section.

Every field name is at once the TOML key (``configs/*.toml``) and, upper-cased behind the
``OFFLOADD_`` prefix, the environment variable (``min_bytes`` -> ``OFFLOADD_MIN_BYTES``); the
section's keys are the ``[daemon]`` table and ``OFFLOADD_DAEMON_<KEY>``. :meth:`Config.load`
reads both (:mod:`offloadd.config.loader`, imported where used since it imports this module).
Sizes accept plain integers or a binary/decimal suffix (``4MiB``, ``256k``, ``1G``). A bad value
raises :class:`ValueError` naming the dotted key, the value and, when loaded, where it came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field, fields
from typing import Any, Literal, get_args

from offloadd.config.daemon import DaemonConfig
from offloadd.config.kinds import (
    Bool,
    Budget,
    Choice,
    DirectIO,
    Dirs,
    Int,
    Kind,
    Names,
    Size,
    check,
    invalid,
)
from offloadd.config.renamed import move_renamed

__all__ = [
    "KINDS",
    "CodecName",
    "Config",
    "DirectIO",
    "EngineName",
    "HostAllocator",
    "IoUring",
    "Tier",
]

Tier = Literal["keep", "cpu", "ssd"]
EngineName = Literal["auto", "native", "python", "kvikio"]
IoUring = Literal["auto", "on", "off"]
HostAllocator = Literal["auto", "caching", "system"]
CodecName = Literal["none", "int8", "fp8-e4m3", "fp8-e5m2", "int4", "int2"]

_ALIGN = 4096


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """How the offloader treats saved activations. Every field has a default that works."""

    tier: Tier = "ssd"
    """Where offloaded activations go. ``"keep"``: hooks installed, everything kept in memory (the
    accounting baseline). ``"ssd"``: written to files in ``ssd_dirs``. ``"cpu"``: CUDA tensors go to
    a pinned host pool of ``host_budget_bytes`` and spill to ``ssd_dirs`` past it; CPU tensors stay
    where they are (moving host memory to host memory saves nothing)."""

    ssd_dirs: tuple[str, ...] = ()
    """Directories for the ssd tier (and the cpu tier's spill), striped chunk by chunk when several
    are given. Empty: a per-user directory on a local, non-tmpfs file system is chosen and logged."""

    min_bytes: int = 1 << 20
    """Tensors smaller than this are kept in memory: moving them costs more than it saves."""

    dedup: bool = True
    """Move a storage once even when several saved tensors (views, transposes, expands) share it."""

    staging_bytes: int = 128 << 20
    """Size of the pre-allocated, page-aligned staging pool that writes go through. When it is full,
    forward waits for writes to finish (backpressure, counted in stats)."""

    host_budget_bytes: int = 2 << 30
    """cpu tier: bytes of pinned host memory to hold activations in before spilling to ssd."""

    prefetch_bytes: int = 128 << 20
    """Backward reads ahead, in reverse pack order, at most this many bytes beyond what is in use."""

    chunk_bytes: int = 4 << 20
    """Unit of I/O and of staging slots; a multiple of 4096. Blocks are split into chunks."""

    io_threads: int = 4
    """Threads of the embedded I/O engine (requests in flight at once). A daemon's engine has its
    own, ``daemon.io_threads``."""

    direct_io: DirectIO = "auto"
    """O_DIRECT use: ``"auto"`` tries it and falls back to buffered I/O where the file system refuses
    it (logged once, shown in stats); ``"on"`` fails instead; ``"off"`` always uses buffered I/O.
    For the embedded engine's files; a daemon's files follow ``daemon.direct_io``."""

    trim_host_bytes: int = 0
    """CPU activations on glibc: hand freed heap pages back to the OS (``malloc_trim``) each time
    this many bytes were moved out or back in; 0 (the default) never does. Read-backs land in
    offloadd's own recycled buffers and in-place writes free each activation as soon as it is
    written, so the heap holds only the forward window and its freed pages are reused warm;
    trimming them makes the next allocations fault in fresh pages, a trade of step time for RSS
    measured in docs/benchmarks/."""

    host_allocator: HostAllocator = "auto"
    """torch's CPU allocator while the Offloader is open. ``"caching"``: offloadd's host cache
    (csrc/host_allocator.cpp), which keeps freed activation blocks warm for the next allocation of
    their size and caps what it keeps at what was live, so that freed activations neither stay
    resident as heap fragments nor fault in again; built with the C++ compiler at first use and
    cached, an error if that fails. ``"system"``: torch's own (glibc's heap). ``"auto"``: the host
    cache for tier ssd on a machine without CUDA, falling back to system with a warning saying why;
    system otherwise."""

    engine: EngineName = "auto"
    """I/O engine. ``"native"``: the C engine (csrc/), which never needs the GIL; ``"python"``: the
    thread-pool reference engine; ``"kvikio"``: GPUDirect Storage for CUDA tensors (host tensors
    use native); ``"auto"``: kvikio for CUDA tensors where kvikio and cuFile work, else native,
    else python, logging what it picked and why. Naming an engine that cannot load is an error."""

    io_uring: IoUring = "auto"
    """Native engine backend: ``"on"`` drives an io_uring ring (error where the kernel or a seccomp
    profile refuses it), ``"off"`` uses its pthread pool, ``"auto"`` uses io_uring where a probe
    succeeds."""

    budget: int | float | None = None
    """A budget for the step's activation peak: offloadd profiles the first step of each input
    shape, then keeps, offloads or recomputes each block of the model so that the most memory a
    step uses above what was in use when its forward began (temporaries included, as CUDA's or
    the host cache's allocator counts it; where neither does, the saved-activation bytes offloadd
    holds) fits, fastest first (see [auto] in auto/planner.py, [measured peaks] in
    auto/probe.py). A size (``"6GiB"``) or a fraction of keep's (``"0.3x"``); ``None`` (off, the
    default) offloads every saved tensor as the tier says. A budget no plan fits in raises,
    naming the smallest feasible one."""

    memsave: bool = False
    """Under ``OFFLOADD=1``: apply :func:`offloadd.memsave` to the model (the root module of the
    first forward) once, so its Conv, ConvTranspose, BatchNorm (eval), ReLU, LeakyReLU, MaxPool and
    Dropout modules save for backward only what the gradients that will be computed need (bitwise
    the same gradients; less saved where gradients flow through frozen layers). In a program,
    call ``offloadd.memsave(model)`` yourself: an :class:`~offloadd.Offloader` does not apply it."""

    codec: CodecName = "none"
    """Lossy compression of saved activations, opt-in: ``"none"`` (the default) stores them
    exactly; ``"int8"``, ``"fp8-e4m3"``, ``"fp8-e5m2"``, ``"int4"``, ``"int2"`` encode the floating
    activations that the ops in ``codec_ops`` save, per group of ``codec_group`` values with a
    range each, before they are kept, moved or written (see [the codes] in codec/quant.py, [what
    gets compressed] in codec/ops.py). Gradients are then approximate: docs/benchmarks holds the
    measured error and loss curves of each codec."""

    codec_group: int = 256
    """Values per quantisation group (a range each); near it, groups follow rows and heads."""

    codec_symmetric: bool = True
    """``int8``: a scale per group around zero (``True``) or a minimum and a step (``False``).
    int4 and int2 always use a minimum and a step; fp8 always a scale."""

    codec_stochastic: bool = False
    """Integer codecs: round stochastically (unbiased) instead of to nearest, from a generator
    seeded per step with ``codec_seed``, so runs reproduce."""

    codec_seed: int = 0
    """Seed of stochastic rounding (mixed with the step number)."""

    codec_min_bytes: int = 64 << 10
    """Floating activations smaller than this are never encoded."""

    codec_ops: tuple[str, ...] = ()
    """Torch functions whose saved activations the codec may encode (``["linear"]``: only linear
    inputs); empty (the default): the list in codec/ops.py, each entry with its reason."""

    compile_ops: bool = True
    """A model compiled whole (``torch.compile(model)``) with inductor streams while it computes:
    its graph empties each saved activation once read and its backward reads it back before use
    (see [emptied in the graph] in runtime/graph_ops.py). Bit-identical to the model compiled
    without offloadd on every model tested, not by construction: off is the switch for one that
    is not. Off: such a model's saved tensors are moved when its forward returns (exact, but
    every one of them is resident at that point)."""

    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    """The daemon's settings: the ``[daemon]`` table, ``OFFLOADD_DAEMON_<KEY>`` in the
    environment (:class:`~offloadd.config.DaemonConfig`). The training side reads only
    ``daemon.socket``: when it is set and the tier is ``ssd``, the ``offloadd serve`` daemon there
    does the I/O. ``offloadd serve`` reads all of it."""

    daemon_socket: InitVar[str | None] = None
    """Deprecated: the first release's name of ``daemon.socket``, read with a DeprecationWarning
    until offloadd 0.3.0 (see [renamed keys] in config/renamed.py). Not a field."""

    def __post_init__(self, daemon_socket: str | None) -> None:
        for name, kind in KINDS.items():
            object.__setattr__(self, name, check(name, kind, getattr(self, name)))
        if not isinstance(self.daemon, DaemonConfig):
            raise invalid("daemon", self.daemon, "a DaemonConfig (the daemon's settings)")
        if daemon_socket is not None:
            old = {"daemon_socket": daemon_socket, "daemon": self.daemon}
            moved = move_renamed(old, "a keyword argument", "keyword")
            object.__setattr__(self, "daemon", moved["daemon"])
        if self.codec_stochastic and self.codec.startswith("fp8"):
            raise ValueError(
                f"codec_stochastic: stochastic rounding is for the integer codecs, not {self.codec}"
            )
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
        level, or its ``[offload]`` table, holds the keys of this class; its ``[daemon]`` table
        the daemon's. ``environ`` (default: ``os.environ``) overrides both with ``OFFLOADD_<KEY>``
        and ``OFFLOADD_DAEMON_<KEY>``; an ``OFFLOADD_*`` variable that is neither a key nor
        reserved (:data:`~offloadd.config.RESERVED_ENV`) raises, so a typo never silently runs
        with defaults. Errors name the dotted key, the value and the file or variable."""
        from offloadd.config.loader import load

        return load(path, environ=environ, base=base)

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
        """Build from ``{key: value}`` as a TOML file holds them (``daemon``: a table, or a
        :class:`DaemonConfig`), converting strings; errors name ``source`` when given."""
        from offloadd.config.loader import build, flatten

        return build(flatten(values, source))

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied and checked. ``daemon`` may be a :class:`DaemonConfig`
        (the whole section) or a mapping of some of its keys, merged into the current section:
        ``cfg.replace(daemon={"socket": path})``. Renamed keys are read with a warning (see
        [renamed keys] in config/renamed.py)."""
        changes = move_renamed(changes, "a keyword argument", "keyword")
        values = self.as_dict()
        section = changes.pop("daemon", values["daemon"])
        if isinstance(section, Mapping):
            section = {**values["daemon"], **section}
        return self.from_mapping({**values, **changes, "daemon": section})

    def as_dict(self) -> dict[str, Any]:
        """``{key: value}`` with the section as a nested dict, as a TOML file would hold it."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["daemon"] = self.daemon.as_dict()
        return out


KINDS: dict[str, Kind] = {
    "tier": Choice(get_args(Tier)),
    "ssd_dirs": Dirs(),
    "min_bytes": Size(),
    "dedup": Bool(),
    "staging_bytes": Size(),
    "host_budget_bytes": Size(),
    "prefetch_bytes": Size(),
    "chunk_bytes": Size(_ALIGN, multiple=_ALIGN),
    "io_threads": Int(1, 256),
    "direct_io": Choice(get_args(DirectIO)),
    "trim_host_bytes": Size(),
    "host_allocator": Choice(get_args(HostAllocator)),
    "engine": Choice(get_args(EngineName)),
    "io_uring": Choice(get_args(IoUring)),
    "budget": Budget(),
    "memsave": Bool(),
    "codec": Choice(get_args(CodecName)),
    "codec_group": Int(8, 1 << 20),
    "codec_symmetric": Bool(),
    "codec_stochastic": Bool(),
    "codec_seed": Int(0, (1 << 63) - 1),
    "codec_min_bytes": Size(),
    "codec_ops": Names(),
    "compile_ops": Bool(),
}
"""How each field but the ``daemon`` section is read and checked (:mod:`offloadd.config.kinds`)."""
