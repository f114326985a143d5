"""``offloadd.Offloader``, the class users call: saved-tensor hooks that offload activations.

It owns a :class:`~offloadd.runtime.runtime.Runtime` (the parts and the hot path) and gives it
the optional stages: the budget planner (:mod:`offloadd.auto`) and the codec
(:mod:`offloadd.codec`). The runtime defines their interfaces (runtime/stages.py) and never
imports them; this module is the edge that joins the three.

Note [one default config]
~~~~~~~~~~~~~~~~~~~~~~~~~
Every entry point starts from the same place: :meth:`Config.from_env` (``OFFLOADD_CONFIG``'s
file, then ``OFFLOADD_*`` variables), then the arguments given in code. ``Offloader()`` in a
script, ``OFFLOADD=1`` around an unmodified one and ``offloadd.relay(model)`` therefore agree on
a machine whose environment says ``OFFLOADD_SSD_DIRS=/nvme``; a ``Config`` passed explicitly is
taken as it is (the environment is not read), and keyword arguments override either.
"""

from __future__ import annotations

from typing import Any

import torch

from offloadd.auto.planner import AutoPlanner
from offloadd.auto.solver import Plan
from offloadd.codec.coder import Codec
from offloadd.config import Config
from offloadd.io.request import Engine
from offloadd.runtime.ordering import Ordering
from offloadd.runtime.runtime import Runtime
from offloadd.runtime.stages import PlannerView, Stages
from offloadd.runtime.stats import Stats

__all__ = ["STAGES", "Offloader"]


def _planner(cfg: Config, view: PlannerView) -> AutoPlanner:
    assert cfg.budget is not None
    return AutoPlanner(cfg.budget, offload=cfg.tier != "keep", view=view)


STAGES = Stages(planner=_planner, coder=Codec)
"""The budget planner (``Config.budget``) and the codec (``Config.codec``)."""


class Offloader:
    """Saved-tensor hooks that offload activations; use as a context manager around forward.

    Inside ``with off:``, each tensor autograd saves for backward is kept, moved to pinned host
    memory or written to files, and read back, in time, when backward needs it; gradients are
    bitwise those of plain PyTorch unless a lossy codec is asked for. Enter it once per forward
    (``with off:`` around each step's forward, as ``OFFLOADD=1`` does): each outermost entry
    begins a training step, at which the read pool unmaps the buffers of sizes that the last two
    steps did not use (see [warm buffers] in io/pools.py). Entered once around the whole loop,
    it unmaps them only when it closes. Backward runs outside the scope.

    Args:
        config (Config | None): the settings, taken as they are; ``None``:
            ``Config.from_env()``, the defaults under ``OFFLOADD_CONFIG``'s file and the
            ``OFFLOADD_*`` variables (see [one default config]). The keyword arguments below
            override its fields.
        io_engine (Engine | None): another I/O engine for the embedded backend (by default
            ``engine`` chooses one). Not with ``daemon.socket``.
        ordering (Ordering | None): how an asynchronous device orders its copies (default:
            CUDA streams and events; tests pass ``SimulatedOrdering``).
        **overrides: any key of :class:`~offloadd.Config`, each read and checked as the
            config file's would be (``"4MiB"`` for a size); a section takes a mapping of some
            of its keys, merged into the config's section, or a whole section object:

            - ``tier`` (str): ``"ssd"`` (default: files in ``ssd_dirs``), ``"cpu"`` (CUDA
              tensors to pinned host memory up to ``host_budget_bytes``, spilling to
              ``ssd_dirs``) or ``"keep"`` (hooks only: the accounting baseline).
            - ``ssd_dirs`` (list[str]): offload directories, striped chunk by chunk; empty: a
              per-user directory on a local disk.
            - ``min_bytes`` (int | str): smaller tensors stay in memory (default 1 MiB).
            - ``dedup`` (bool): move a storage shared by several saved tensors once.
            - ``staging_bytes``, ``host_budget_bytes``, ``prefetch_bytes``, ``chunk_bytes``
              (int | str): the write staging pool, the cpu tier's pinned budget, backward's
              read-ahead, and the I/O unit (a multiple of 4096).
            - ``io_threads`` (int), ``direct_io`` (``"auto"``/``"on"``/``"off"``),
              ``engine`` (``"auto"``/``"native"``/``"python"``/``"kvikio"``), ``io_uring``
              (``"auto"``/``"on"``/``"off"``): the embedded I/O engine.
            - ``trim_host_bytes`` (int | str), ``host_allocator`` (``"auto"``/``"caching"``/
              ``"system"``): host memory of CPU activations (glibc trims, offloadd's cache).
            - ``budget`` (int | float | str | None): a peak for saved activations (``"6GiB"``
              or ``"0.3x"`` of keep's); offloadd then keeps, offloads or recomputes each
              block to fit. ``None`` (default): offload everything the tier says.
            - ``memsave`` (bool): under ``OFFLOADD=1`` only, apply :func:`offloadd.memsave`.
            - ``compile_ops`` (bool): a model compiled whole streams its saved activations.
            - ``codec`` (mapping | CodecConfig): lossy compression, off by default:
              ``codec={"name": "int8"}`` and its other keys ``group``, ``symmetric``,
              ``stochastic``, ``seed``, ``min_bytes``, ``ops``.
            - ``daemon`` (mapping | DaemonConfig): ``daemon={"socket": path}`` has the
              ``offloadd serve`` daemon there do the ssd tier's I/O; ``trusted_uids`` the
              uids besides its own and root whose daemon it talks to.

            Old names (``daemon_socket``, ``codec="int8"``, ``codec_group``, ...) are read with
            a DeprecationWarning until 0.3.0 (docs/usage-envvar.md, "Deprecated names").

    Raises:
        ValueError: a key that does not exist, or a value that is not of its kind (the
            message names the dotted key, as ``codec.group: 3 is not an integer in
            8..1048576``); two keys that do not fit together (``staging_bytes`` below
            ``chunk_bytes``); an offload directory that is missing or not writable;
            ``codec.ops`` naming no torch function; ``io_engine`` with ``daemon.socket``.
        RuntimeError: an engine or backend asked for by name that cannot run here
            (``engine="native"``/``"kvikio"``, ``io_uring="on"``), or
            ``host_allocator="caching"`` where the host cache cannot be loaded. Entering a
            closed Offloader, or a codec under ``torch.compile(model)``, raises it too.
        ConnectionError: ``daemon.socket`` is set and the daemon there cannot be reached,
            is not trusted, or refuses the session.

    Example:
        >>> import torch
        >>> from offloadd import Offloader
        >>> model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
        ...                             torch.nn.Linear(4096, 1024))
        >>> off = Offloader(tier="ssd", min_bytes="64KiB")  # or Offloader(Config.load(path))
        >>> for step in range(3):
        ...     x = torch.randn(64, 1024)
        ...     with off:  # forward inside: saved activations leave as they are saved
        ...         loss = model(x).square().mean()
        ...     loss.backward()  # outside: each comes back before the op that needs it
        >>> print(off.stats().summary())  # doctest: +SKIP
        >>> off.close()
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        io_engine: Engine | None = None,
        ordering: Ordering | None = None,
        **overrides: Any,
    ) -> None:
        cfg = config if config is not None else Config.from_env()
        if overrides:
            cfg = cfg.replace(**overrides)
        self._runtime = Runtime(cfg, io_engine=io_engine, ordering=ordering, stages=STAGES)

    @property
    def config(self) -> Config:
        """The settings this Offloader runs with."""
        return self._runtime.config

    @property
    def runtime(self) -> Runtime:
        """The machinery (its parts: ``writer``, ``reader``, ``backend``, ``ledger``, …), for
        the tools, integrations and tests that look inside; not needed to train."""
        return self._runtime

    @property
    def planner(self) -> AutoPlanner | None:
        """The budget planner (None without a budget)."""
        planner = self._runtime.planner
        assert planner is None or isinstance(planner, AutoPlanner)
        return planner

    def __enter__(self) -> Offloader:
        self._runtime.enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._runtime.exit(exc)  # type: ignore[arg-type]

    def note_module(self, module: torch.nn.Module) -> None:
        """Treat the parameters and buffers of ``module`` and its submodules as parameters
        (never moved), from now on and after they change (``.to()``).

        Modules called in the scope are found by themselves (see [no module hook] in
        compiled.py); integrations call this for modules that run outside it (see
        ``offloadd.integrations.autoload``). With a budget, the first module noted is the model
        whose blocks are planned."""
        self._runtime.note_module(module)

    def plan(self) -> Plan | None:
        """With a budget: the plan of the last step planned (see [auto] in auto/planner.py),
        made now if a profile step's backward has run; None before that, or without a budget."""
        plan: Plan | None = self._runtime.plan()
        return plan

    def stats(self) -> Stats:
        """A snapshot of the counters (see :class:`~offloadd.Stats`)."""
        return self._runtime.stats()

    def synchronize(self) -> None:
        """Wait until no write or read is in flight (e.g. before reading stats in a benchmark).

        Called between ops, it first captures what this thread packed and has not captured."""
        self._runtime.synchronize()

    def close(self) -> None:
        """Finish in-flight I/O, release files and memory. Idempotent; also runs at exit."""
        self._runtime.close()

    def detach(self) -> None:
        """Never close this Offloader, not even at exit: for a forked child, in which the
        parent's I/O threads do not exist (closing would wait for them)."""
        self._runtime.detach()
