"""``offloadd doctor``'s checks of the machine: versions, the I/O engines, GDS, memory, and what
``engine = auto`` and ``host_allocator = auto`` pick.

Every decision is the runtime's own, asked without side effects: :func:`offloadd.io.engine_choice.
choose_host_engine` and ``choose_device_engine``, :func:`offloadd.runtime.host_allocator.choose`,
the native engine's io_uring probe, :func:`offloadd.io.gds.probe`. Nothing here starts an engine
or installs an allocator (the host cache's extension module is loaded, not installed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import resource
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import torch

from offloadd import __version__
from offloadd.config import Config
from offloadd.io import engine_choice, native
from offloadd.io.buffers import AlignedBuffer
from offloadd.io.gds import install_hint
from offloadd.io.hugepages import HUGE_PAGE, advise_huge_pages
from offloadd.runtime import host_allocator
from offloadd.units import format_bytes

__all__ = [
    "Check",
    "Status",
    "choice_checks",
    "gds_checks",
    "host_cache_check",
    "io_checks",
    "memory_checks",
    "version_checks",
]

Status = Literal["ok", "info", "warn", "fail"]
"""``info``: a fact, as good as ``ok``; ``warn``: works, worse than it could; ``fail``: cannot
work as configured."""


@dataclass(slots=True)
class Check:
    """One finding: a stable ``id``, its status, one line for people, facts for programs."""

    id: str
    status: Status
    message: str
    facts: dict[str, Any] = field(default_factory=dict)
    subject: str = ""
    """What it is about where a section has several of a kind (a directory); else empty."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "subject": self.subject,
            "status": self.status,
            "message": self.message,
            "facts": self.facts,
        }


def version_checks() -> list[Check]:
    uname = platform.uname()
    cuda_build = torch.version.cuda
    available = bool(torch.backends.cuda.is_built() and torch.cuda.is_available())
    devices = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if available
        else []
    )
    if available:
        cuda = Check(
            "cuda", "ok", f"CUDA {cuda_build} available: {len(devices)} device(s) ({devices[0]})"
        )
    elif cuda_build is None:
        cuda = Check("cuda", "info", "CUDA not available: this torch is a CPU build")
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        cuda = Check(
            "cuda", "info", f"torch is built for CUDA {cuda_build}, but no device is usable{hint}"
        )
    cuda.facts = {"build": cuda_build, "available": available, "devices": devices}
    return [
        Check(
            "offloadd",
            "info",
            f"offloadd {__version__}, Python {platform.python_version()}, "
            f"{uname.system} {uname.release} ({uname.machine})",
            {"offloadd": __version__, "python": platform.python_version(), "kernel": uname.release},
        ),
        Check("torch", "ok", f"torch {torch.__version__}", {"version": torch.__version__}),
        cuda,
    ]


def io_checks(cfg: Config) -> list[Check]:
    """The native extension and the io_uring probe (the native engine's own)."""
    ok, why = native.available()
    ext = Check(
        "native",
        "ok" if ok else "warn",
        "native engine: the extension loads" if ok else f"native engine unavailable: {why}",
        {"available": ok, "reason": why},
    )
    if not ok:
        return [ext, Check("io_uring", "info", "io_uring: not probed (no native engine)")]
    uring_ok, uring_why = native.uring_available()
    facts = {"available": uring_ok, "reason": uring_why, "setting": cfg.io_uring}
    if uring_ok:
        return [ext, Check("io_uring", "ok", f"io_uring works ({uring_why})", facts)]
    hint = ""
    if "Operation not permitted" in uring_why or "Function not implemented" in uring_why:
        hint = (
            " (a seccomp profile, such as a container runtime's default, or "
            "kernel.io_uring_disabled refuses io_uring_setup)"
        )
    used = cfg.io_uring != "off"
    message = f"io_uring unavailable: {uring_why}{hint}"
    if used:
        message += "; the native engine uses its threads"
    return [ext, Check("io_uring", "warn" if used else "info", message, facts)]


def _distribution(names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return name, metadata.version(name)
    return None


def gds_checks(cfg: Config) -> list[Check]:
    """kvikio and cuFile, found without importing kvikio (it needs libcuda), then GDS's probe."""
    found = importlib.util.find_spec("kvikio") is not None
    dist = _distribution(("kvikio-cu13", "kvikio-cu12", "kvikio-cu11", "kvikio")) if found else None
    kvikio = Check(
        "kvikio",
        "info",
        (f"kvikio {dist[1]} installed ({dist[0]})" if dist else "kvikio installed")
        if found
        else f"kvikio not installed ({install_hint()})",
        {"installed": found, "version": dist[1] if dist else None},
    )
    nvfs = Path("/proc/driver/nvidia-fs").exists()
    compat = os.environ.get("KVIKIO_COMPAT_MODE")
    cufile = Check(
        "cufile",
        "info",
        f"nvidia-fs driver {'loaded' if nvfs else 'not loaded'}; KVIKIO_COMPAT_MODE "
        f"{compat if compat is not None else 'not set'}; /etc/cufile.json "
        f"{'present' if Path('/etc/cufile.json').exists() else 'absent'}",
        {"nvidia_fs": nvfs, "compat_mode_env": compat},
    )
    from offloadd.io import gds

    ok, why = gds.probe()
    mode = "gds" if ok else ("compat" if "would use POSIX" in why else "unavailable")
    status: Status = "ok" if ok else ("warn" if cfg.engine == "kvikio" else "info")
    probe = Check(
        "gds",
        status,
        f"GDS {'available' if ok else 'not used'}: {why}",
        {"mode": mode, "reason": why},
    )
    return [kvikio, cufile, probe]


def _thp() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("enabled", "defrag"):
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
        except OSError:
            out[name] = None
            continue
        chosen = [w for w in text.split() if w.startswith("[")]
        out[name] = chosen[0].strip("[]") if chosen else text.strip()
    return out


def _meminfo(keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0])
    return out


def _limit(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else format_bytes(n)


def memory_checks(cfg: Config) -> list[Check]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    old_kernel = tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit()) < (5, 12)
    low = soft != resource.RLIM_INFINITY and soft < (1 << 20)
    memlock = Check(
        "memlock",
        "warn" if old_kernel and low else "ok",
        f"ulimit -l {_limit(soft)} (hard {_limit(hard)}): offloadd calls no mlock (CUDA pins "
        "host memory through its driver)"
        + (
            "; before Linux 5.12 io_uring rings count against it (a refused ring: threads)"
            if old_kernel and low
            else ""
        ),
        {
            "soft_bytes": None if soft == resource.RLIM_INFINITY else soft,
            "hard_bytes": None if hard == resource.RLIM_INFINITY else hard,
        },
    )
    thp = _thp()
    buf = AlignedBuffer(2 * HUGE_PAGE, huge_pages=True)  # as the staging pool: advised, touched
    try:
        collapsed = advise_huge_pages(buf.address, buf.nbytes)
    finally:
        buf.close()
    never = thp["enabled"] == "never"
    huge = Check(
        "transparent_hugepage",
        "warn" if never else "ok",
        f"transparent huge pages {thp['enabled']} (defrag {thp['defrag']}); a test buffer "
        f"{'got' if collapsed else 'did not get'} huge pages"
        + ("; I/O buffers stay on 4 KiB pages, slower ([huge-page buffers])" if never else ""),
        {**thp, "granted": collapsed},
    )
    info = _meminfo(("HugePages_Total", "HugePages_Free", "Hugepagesize"))
    hugetlb = Check(
        "hugetlb",
        "info",
        f"HugePages_Total {info.get('HugePages_Total', '?')}, free "
        f"{info.get('HugePages_Free', '?')} ({info.get('Hugepagesize', '?')} kB each): "
        "reserved pages offloadd does not use",
        {"total": info.get("HugePages_Total"), "free": info.get("HugePages_Free")},
    )
    return [memlock, huge, hugetlb, host_cache_check()]


def host_cache_check() -> Check:
    """Whether the host cache is built (by offloadd's install) and loads."""
    facts: dict[str, Any] = {"library": None, "state": "unavailable"}
    try:
        cache = host_allocator.load()  # loads it; installs nothing
    except host_allocator.HostAllocatorError as e:
        return Check("host_cache", "warn", f"host cache unavailable: {e}", facts)
    facts.update(library=cache.path, state="built")
    return Check("host_cache", "ok", f"host cache built for torch {torch.__version__}", facts)


def choice_checks(cfg: Config, host_cache: Check, daemon_does_io: bool) -> list[Check]:
    """What the configured (and the ``auto``) settings pick, and why; ``host_cache``: the
    result of :func:`host_cache_check`."""
    out: list[Check] = []
    settings = [("engine", cfg)]
    if cfg.engine != "auto" or cfg.io_uring != "auto":
        settings.append(("engine_auto", cfg.replace(engine="auto", io_uring="auto")))
    for key, c in settings:
        label = f"engine = {c.engine}, io_uring = {c.io_uring}"
        try:
            choice = engine_choice.choose_host_engine(c)
        except RuntimeError as e:
            out.append(Check(key, "fail", str(e).removeprefix("offloadd: "), {"name": None}))
            continue
        picked = {"name": choice.name, "reason": choice.reason}
        out.append(Check(key, "ok", f"{label} -> {choice.name} ({choice.reason})", picked))
    try:
        dev = engine_choice.choose_device_engine(cfg)
        out.append(
            Check(
                "cuda_tensors",
                "ok",
                f"CUDA tensors -> {dev.name} ({dev.reason})",
                {"name": dev.name, "reason": dev.reason},
            )
        )
    except RuntimeError as e:
        out.append(Check("cuda_tensors", "fail", str(e).removeprefix("offloadd: "), {"name": None}))
    if daemon_does_io:  # the embedded engine's choices: another process does the I/O
        for check in out:
            check.status = "warn" if check.status == "fail" else "info"
            check.message += "; unused: the daemon at daemon.socket does the I/O"
    wanted, why = host_allocator.choose(cfg)
    state = host_cache.facts["state"]
    facts: dict[str, Any] = {"wanted": wanted, "reason": why, "host_cache": state}
    label = "host_allocator"  # the reason names the setting
    if not wanted:
        out.append(Check("host_allocator", "ok", f"{label} -> system ({why})", facts))
    elif state != "unavailable":
        out.append(Check("host_allocator", "ok", f"{label} -> caching ({why})", facts))
    elif cfg.host_allocator == "caching":
        out.append(Check("host_allocator", "fail", f"{why}, but {host_cache.message}", facts))
    else:
        out.append(
            Check(
                "host_allocator",
                "warn",
                f"{label} -> system, with a warning: {host_cache.message} ({why})",
                facts,
            )
        )
    return out
