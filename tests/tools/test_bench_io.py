"""``offloadd bench io`` smoke-runs at a tiny size (figures are never asserted, only their shape)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support.cli import offloadd_cli

ENGINE_PARAMS = ("default",)  # disk_dir once: the benchmark runs every engine itself


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "offloadd", "bench", "io", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_bench_io_end_to_end(disk_dir: Path) -> None:
    out = disk_dir.parent / f"{disk_dir.name}.json"
    args = ["--dir", str(disk_dir), "--total-bytes", "16MiB", "--request-bytes", "4MiB"]
    proc = _bench(*args, "--pairs", "1", "--gil", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    out.unlink()
    (entry,) = result["sizes"]
    engines = [e for e in ("native-uring", "native-threads", "python") if e in entry]
    assert "native-threads" in engines and "python" in engines
    have_fio = shutil.which("fio") is not None
    for name in engines:
        e = entry[name]
        assert e["write_GBps"] > 0 and e["read_GBps"] > 0
        assert e["write_cpu_s_per_GB"] >= 0 and e["gil_read_vs_idle"] > 0
        if have_fio:
            assert e["fio_write_GBps"] > 0 and e["fio_read_GBps"] > 0
            assert e["write_vs_fio"] > 0 and e["read_vs_fio"] > 0
    assert "python" in proc.stdout and "w/fio" in proc.stdout  # the summary table
    assert not any(p.name.startswith("offloadd-bench-fio") for p in disk_dir.iterdir())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "rust"], "--engine: unknown engine 'rust'"),
        (["--request-bytes", "5000"], "--request-bytes: 5000 is not a positive multiple of 4096"),
        (["--total-bytes", "lots"], "--total-bytes"),
        (["--dir", "/dev/null/offloadd"], "--dir '/dev/null/offloadd' is not a writable"),
        (["--pairs", "0"], "--pairs must be at least 1"),
    ],
)
def test_bench_io_bad_arguments(args: list[str], message: str) -> None:
    base = ["bench", "io", "--total-bytes", "16MiB", "--request-bytes", "4MiB"]
    code, _, err = offloadd_cli(*base, *args)  # the last one wins
    assert code == 2
    assert message in err


def test_fio_span_from_latency_logs(tmp_path: Path) -> None:
    """[fio's wall span]: two jobs that did not overlap span both, unlike fio's longest job."""
    from offloadd.tools.bench.io_fio import lat_log_span

    a, b = tmp_path / "req_lat.1.log", tmp_path / "req_lat.2.log"
    # time_ms (completion), latency_ns, direction, size, offset
    a.write_text("1000, 20000000, 1, 4194304, 0\n1010, 25000000, 1, 4194304, 4194304\n")
    b.write_text("1100, 30000000, 1, 4194304, 0\n")
    span = lat_log_span([str(a), str(b)])
    assert span == pytest.approx((1100 - (1000 - 20)) / 1000)
    (tmp_path / "empty.log").write_text("")
    assert lat_log_span([str(tmp_path / "empty.log")]) is None
