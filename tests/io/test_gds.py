"""GPUDirect Storage (kvikio): CUDA tensors written and read without host staging.

The GPU tests skip where a GPU, kvikio or cuFile is missing; the error path runs everywhere.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from offloadd import Offloader
from offloadd.io import gds
from offloadd.io.request import Op, Request
from tests._support.helpers import MakeOffloader, assert_bitwise_equal
from tests.runtime.test_cuda import (
    check_inplace_before_capture_raises,
    check_producer_stream,
    train_cuda,
)

ENGINE_PARAMS = ("default",)  # the host engine does not matter here


def test_kvikio_named_without_gds_fails_with_reason(disk_dir: Path) -> None:
    ok, why = gds.probe()
    if ok:
        pytest.skip("GDS works here")
    with pytest.raises(RuntimeError, match="engine = kvikio, but") as e:
        Offloader(ssd_dirs=[str(disk_dir)], engine="kvikio")
    assert why in str(e.value)


@pytest.mark.parametrize(
    ("cuda", "hint"),
    [
        ("12.8", "pip install 'offloadd[gds]'"),
        ("13.0", "pip install 'offloadd[gds-cu13]'"),
        (None, "pip install 'offloadd[gds]'"),
        ("11.8", "pip install kvikio-cu11"),  # no extra of ours: kvikio's own package
    ],
)
def test_install_hint_names_the_extra_for_torchs_cuda(
    monkeypatch: pytest.MonkeyPatch, cuda: str | None, hint: str
) -> None:
    monkeypatch.setattr(gds.torch.version, "cuda", cuda)
    assert gds.install_hint() == hint


def test_every_gds_extra_names_a_kvikio() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["gds"][0].startswith("kvikio-cu12")
    assert extras["gds-cu13"][0].startswith("kvikio-cu13")


def test_auto_without_gds_keeps_cpu_paths(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    off = make_offloader(disk_dir, engine="auto")
    assert "kvikio" not in off.stats().engine
    off.close()


def _need_gds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skips without GDS, unless kvikio imports and KVIKIO_COMPAT_MODE=ON asks for its POSIX
    mode (scripts/gpu_check.sh, on a GPU machine without the nvidia-fs driver): then the kvikio
    engine's own code runs for real, its transfers bounced through host memory by kvikio."""
    ok, why = gds.probe()
    if ok:
        return
    if os.environ.get("KVIKIO_COMPAT_MODE", "").upper() == "ON" and "kvikio imports" in why:
        monkeypatch.setattr(gds, "probe", lambda: (True, "kvikio in compat mode (test)"))
        return
    pytest.skip(f"GDS unavailable: {why}")


@pytest.mark.cuda
def test_gds_bit_identical(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_gds(monkeypatch)
    ref = train_cuda(None, rows=1000)
    off = make_offloader(disk_dir, engine="kvikio")
    got = train_cuda(off, rows=1000)
    st = off.stats()
    off.close()
    assert_bitwise_equal(ref, got)
    assert st.engine.endswith("+kvikio") and st.bytes_written > 0 and st.bytes_read > 0


@pytest.mark.cuda
def test_gds_inplace_before_capture_raises(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_gds(monkeypatch)
    check_inplace_before_capture_raises(make_offloader(disk_dir, engine="kvikio"))


@pytest.mark.cuda
def test_gds_write_waits_for_the_producer_stream(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_gds(monkeypatch)
    check_producer_stream(make_offloader(disk_dir, engine="kvikio"))


@pytest.mark.cuda
def test_gds_write_error_falls_back_exactly(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_gds(monkeypatch)
    real = gds.KvikioEngine.transfer

    def failing(self: gds.KvikioEngine, request: Request) -> None:
        if request.op is Op.WRITE:
            raise OSError(errno.ENOSPC, "injected", request.path)
        real(self, request)

    monkeypatch.setattr(gds.KvikioEngine, "transfer", failing)
    ref = train_cuda(None, rows=1000)
    off = make_offloader(disk_dir, engine="kvikio")
    with pytest.warns(RuntimeWarning, match="write failed"):
        got = train_cuda(off, rows=1000)
    st = off.stats()
    off.close()
    assert_bitwise_equal(ref, got)
    assert st.fallbacks > 0
