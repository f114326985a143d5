"""A description of the machine a measurement ran on: CPU, memory, disk, GPU, versions."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch

from offloadd import __version__
from offloadd.io.files import filesystem_type

__all__ = ["command_line", "describe_machine", "machine_line"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _disk(path: str) -> dict[str, Any]:
    """File system, device and size of the mount that holds ``path``."""
    real = os.path.realpath(path)
    best = None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and (
            best is None or len(mp) > len(best.mountpoint)
        ):
            best = part
    usage = psutil.disk_usage(real)
    out: dict[str, Any] = {
        "path": real,
        "fs": filesystem_type(real),
        "total_bytes": usage.total,
        "free_bytes": usage.free,
    }
    if best is not None:
        out["device"] = best.device
        out["mountpoint"] = best.mountpoint
        name = os.path.basename(os.path.realpath(best.device)) if best.device else ""
        for cand in (name, name.rstrip("0123456789").removesuffix("p")):
            model = Path(f"/sys/block/{cand}/device/model")
            rotational = Path(f"/sys/block/{cand}/queue/rotational")
            if cand and model.exists():
                out["model"] = model.read_text().strip()
            if cand and rotational.exists():
                out["rotational"] = rotational.read_text().strip() == "1"
    return out


def describe_machine(device: str, offload_dir: str | None = None) -> dict[str, Any]:
    """CPU, cores, RAM, the offload directory's disk, GPU, and library versions."""
    out: dict[str, Any] = {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_bytes": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "offloadd": __version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if offload_dir is not None and os.path.isdir(offload_dir):
        out["disk"] = _disk(offload_dir)
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        out["gpu"] = {
            "name": props.name,
            "memory_bytes": props.total_memory,
            "cuda": torch.version.cuda,
        }
    with contextlib.suppress(metadata.PackageNotFoundError):
        out["transformers"] = metadata.version("transformers")
    return out


def machine_line(m: dict[str, Any]) -> str:
    """One line for plot titles and reports."""
    gib = 1 << 30
    gpu = m.get("gpu")
    where = (
        f"{gpu['name']} ({gpu['memory_bytes'] / gib:.0f} GiB)"
        if gpu
        else f"{m['cpu']}, {m['logical_cores']} cores"
    )
    return f"{where}, {m['ram_bytes'] / gib:.0f} GiB RAM, torch {m['torch']}"


def command_line() -> str:
    """How this run was started, as a person would type it."""
    argv = list(sys.argv)
    if argv[0].endswith("__main__.py"):
        argv[0] = "python -m offloadd"
    elif argv[0].endswith(".py"):
        argv[0] = f"python {argv[0]}"
    else:
        argv[0] = Path(argv[0]).name
    return " ".join(argv)
