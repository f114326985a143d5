"""The native libraries are built by offloadd's install, never at run time (docs/native.md): each
extension module is built and loads, ships its type stub, and the host cache and memsave's C++
ops work in a process where every compiler fails and none is on PATH."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

EXTENSIONS = {
    "offloadd.io._native": "csrc/io_native",
    "offloadd.codec._kernels": "csrc/codec",
    "offloadd.relay._write_guard": "csrc/write_guard",
    "offloadd.runtime._held": "csrc/hot_path",
    "offloadd.runtime._host_cache": "csrc/host_allocator",
    "offloadd.memsave._kernels": "csrc/memsave",
}
"""Every extension module setup.py builds, with its folder of csrc/."""

ENGINE_PARAMS = ("python",)  # disk_dir once: the child picks its engine itself
REBUILD = "build them in place: python setup.py build_ext --inplace (docs/native.md)"


@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_each_extension_is_built_and_loads(name: str) -> None:
    import torch  # noqa: F401  (the torch libraries link against the torch loaded first)

    try:
        module = importlib.import_module(name)
    except ImportError as e:
        pytest.fail(f"{name} is not built or does not load ({e}); {REBUILD}")
    stub = Path(str(module.__file__)).parent / (name.rsplit(".", 1)[1] + ".pyi")
    assert stub.is_file(), f"{name} has no type stub {stub}"
    assert (ROOT / EXTENSIONS[name]).is_dir()


NATIVE_TESTS = "csrc/tests"
"""The C tests of the libraries (csrc/tests/run.sh): the one folder of csrc/ that is no library."""


def test_setup_builds_every_folder_of_csrc() -> None:
    folders = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").iterdir() if p.is_dir()}
    assert folders == {*EXTENSIONS.values(), NATIVE_TESTS}
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    for name, folder in EXTENSIONS.items():
        assert f'"{name}"' in setup and f'"{folder}/' in setup, (name, folder)


COMPILER_NAMES = ("cc", "c++", "gcc", "g++", "clang", "clang++", "ld", "ninja", "nvcc")

CHILD = """
import torch
from torch import nn

import offloadd
from offloadd.memsave import kernels
from offloadd.runtime import host_allocator

# memsave: its native library serves, and a ReLU records the C++ node of its op
k = kernels.native()
assert k is not None, "memsave's kernels did not load"
x = torch.randn(4099, requires_grad=True)
y = offloadd.memsave(nn.ReLU())(x * 1)
assert y.grad_fn.name() == "ReluBitsBackward", y.grad_fn
y.sum().backward()
assert torch.equal(x.grad, (x > 0).float())
out, bits = k.relu(x.detach(), False)
assert torch.equal(out, torch.relu(x.detach())) and torch.equal(k.pack(out, False), bits)

# the host cache, asked for by name: an Offloader training on it
off = offloadd.Offloader(
    tier="ssd", ssd_dirs=[DISK], min_bytes=64 << 10, host_allocator="caching"
)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
for _ in range(3):
    with off:
        loss = model(torch.randn(384, 256)).square().mean()
    loss.backward()
off.synchronize()
st = off.stats()
off.close()
assert st.host_allocator == "caching" and st.host_cache_hits > 0, st
assert st.offloaded_bytes > 0
assert host_allocator.current() is None
print("ok")
"""


def test_no_compiler_is_run_at_run_time(tmp_path: Path, disk_dir: Path) -> None:
    """CC and CXX name /bin/false, PATH holds only stand-ins for the compilers that record any
    call and fail, HOME and the cache directory are empty: the host cache (host_allocator =
    "caching") and memsave's C++ ops still serve, and nothing was compiled or cached."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "compiler-calls"
    for name in COMPILER_NAMES:
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 1\n', encoding="utf-8")
        tool.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("OFFLOADD", "TORCH_EXTENSIONS"))
    }
    env.update(
        CC="/bin/false",
        CXX="/bin/false",
        PATH=str(bin_dir),
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
    )
    done = subprocess.run(
        [sys.executable, "-c", f"DISK = {str(disk_dir)!r}\n" + textwrap.dedent(CHILD)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "ok"
    assert not calls.exists(), calls.read_text(encoding="utf-8")
    made = [p for p in home.rglob("*") if p.is_file()]
    assert made == [], made
