from __future__ import annotations

import functools
import gc
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from offloadd import Offloader
from offloadd.io import native
from offloadd.io.files import filesystem_type
from tests._support import helpers
from tests._support.daemon_proc import DaemonProc, held_descriptors

_MEMORY_FS = {"tmpfs", "ramfs"}


# Every test that does I/O (uses ``disk_dir``) runs on each engine: the native engine with each
# backend, and the Python reference engine. Tests that also use the ``backend`` fixture run once
# more through a real daemon (which does the I/O with its own engine). By default only the first
# engine that runs here (what ``engine = "auto"`` picks) is in the quick set: the others are
# marked slow, but in the tests marked ``every_engine`` (the engines' own tests and the
# equivalence suite), where they all run by default.
ENGINES = ("native-uring", "native-threads", "python")


def _first_engine() -> str:
    if native.available()[0] and not native.uring_available()[0]:
        return "native-threads"
    return ENGINES[0]  # native-uring: where the native engine is missing, its fixture fails


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine_name" not in metafunc.fixturenames:
        return
    # a module that picks its engines itself sets ENGINE_PARAMS (e.g. io/test_native.py)
    params = getattr(metafunc.module, "ENGINE_PARAMS", None)
    quick: tuple[str, ...] = ()
    if params is None:
        params = ENGINES
        every = metafunc.definition.get_closest_marker("every_engine") is not None
        quick = ENGINES if every else (_first_engine(),)

    def param(engine: str, *values: str, name: str) -> Any:
        marks = () if not quick or engine in quick else (pytest.mark.slow,)
        return pytest.param(engine, *values, marks=marks, id=name)

    if "backend" in metafunc.fixturenames:
        combos = [(e, "embedded") for e in params] + [(quick[0] if quick else params[0], "daemon")]
        metafunc.parametrize(
            ("engine_name", "backend"),
            [param(e, b, name=e if b == "embedded" else b) for e, b in combos],
            indirect=True,
        )
    else:
        metafunc.parametrize("engine_name", [param(e, name=e) for e in params], indirect=True)


@pytest.fixture
def engine_name(request: pytest.FixtureRequest) -> str:
    """The engine this test runs on (``engine_options`` are its Offloader options)."""
    name: str = request.param
    if name.startswith("native"):
        ok, why = native.available()
        if not ok:
            pytest.fail(f"native engine unavailable: {why}")  # it must build wherever CI runs
        if name == "native-uring" and not native.uring_available()[0]:
            pytest.skip(f"io_uring unavailable: {native.uring_available()[1]}")
    return name


@pytest.fixture
def engine_options(engine_name: str) -> dict[str, str]:
    """The Offloader options that pick this test's engine."""
    return dict(helpers.ENGINE_OPTIONS[engine_name])


@pytest.fixture
def offload_options(
    request: pytest.FixtureRequest, engine_options: dict[str, str]
) -> dict[str, object]:
    """The Offloader options of this test's engine, and, in a test run through the daemon by
    the ``backend`` fixture, its socket. Asking for the fixture does not run a test on the
    backends: only naming ``backend`` does (see pytest_generate_tests)."""
    opts: dict[str, object] = dict(engine_options)
    if "backend" in request.fixturenames and request.getfixturevalue("backend") == "daemon":
        proc: DaemonProc = request.getfixturevalue("daemon")
        opts["daemon"] = {"socket": proc.socket}
    return opts


@pytest.fixture
def make_offloader(offload_options: dict[str, object]) -> helpers.MakeOffloader:
    """``make_offloader(directory, **overrides)``: ``helpers.small_offloader`` on this test's
    engine and backend (``offload_options``), the overrides taking precedence."""

    def make(directory: object, **overrides: object) -> Offloader:
        return helpers.small_offloader(directory, **{**offload_options, **overrides})

    return make


@pytest.fixture
def make_engine(engine_options: dict[str, str]) -> helpers.MakeEngine:
    """``make_engine(num_threads)``: a standalone engine of the kind this test runs on."""
    return functools.partial(helpers.open_engine, options=engine_options)


@pytest.fixture(params=["native", "torch-ops"])
def memsave_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a memsave test on its native library (csrc/memsave/, offloadd.memsave._kernels)
    and on its torch-op path with the Python functions."""
    from offloadd.memsave import kernels

    if request.param == "native":
        if kernels.native() is None:
            pytest.skip("memsave's native library is unavailable here")
        yield request.param
    else:
        with kernels.torch_ops_only():
            assert kernels.native() is None
            yield request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _disk_root() -> str:
    """A directory on real disk (ext4/xfs, not tmpfs: tmpfs does not enforce O_DIRECT rules)."""
    for cand in (
        os.environ.get("OFFLOADD_TEST_DIR"),
        tempfile.gettempdir(),
        "/var/tmp",
        os.getcwd(),
    ):
        if cand and os.path.isdir(cand) and filesystem_type(cand) not in _MEMORY_FS:
            return cand
    pytest.skip("no disk-backed directory for offload files")


@pytest.fixture
def disk_dir(engine_name: str) -> Iterator[Path]:
    """A fresh directory on a disk file system; asserts nothing is left in it afterwards."""
    d = Path(tempfile.mkdtemp(prefix="offloadd-test-", dir=_disk_root()))
    yield d
    leftovers = list(d.iterdir())
    for p in leftovers:
        p.unlink()
    d.rmdir()
    assert not leftovers, f"files left behind: {leftovers}"


@pytest.fixture(scope="session")
def daemon() -> Iterator[DaemonProc]:
    """One real ``offloadd serve`` subprocess shared by the tests that run in daemon mode."""
    root = Path(tempfile.mkdtemp(prefix="offloadd-daemon-", dir=_disk_root()))
    proc = DaemonProc(root).start()
    yield proc
    assert proc.stop() == 0, proc.log_text()
    assert not os.path.exists(proc.socket), "socket left behind"
    leftovers = [p for d in proc.dirs for p in d.iterdir()]
    assert not leftovers, f"files left behind: {leftovers}"
    for d in proc.dirs:
        d.rmdir()
    (root / "run").rmdir()
    (root / "daemon.log").unlink()
    root.rmdir()


@pytest.fixture
def own_daemon() -> Iterator[Callable[..., DaemonProc]]:
    """Daemons of the test's own (killed, paused, restarted, configured): made by calling the
    fixture with ``offloadd serve`` arguments (and ``dirs=``, ``env=``); afterwards each is
    resumed and stopped, and no file may be left in their directories."""
    root = Path(tempfile.mkdtemp(prefix="offloadd-own-", dir=_disk_root()))
    procs: list[DaemonProc] = []

    def make(
        *args: str, dirs: list[Path] | None = None, env: dict[str, str] | None = None
    ) -> DaemonProc:
        p = DaemonProc(root, *args, dirs=dirs, env=env)
        procs.append(p)
        return p

    yield make
    for p in procs:
        if p.proc is not None and p.proc.poll() is None:
            p.resume()
            p.stop()
    leftovers = [q for p in procs for d in p.dirs if d.exists() for q in d.iterdir()]
    shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, f"files left behind: {leftovers}"


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the embedded engine and again through a real daemon (``make_offloader``
    and the other factories pick the daemon up); in daemon mode, afterwards no session, file or memfd may be left."""
    if request.param == "embedded":
        yield "embedded"
        return
    params = getattr(request.node, "callspec", None)
    tier = params.params.get("tier", "ssd") if params is not None else "ssd"
    if tier != "ssd":
        pytest.skip(f"tier {tier} does not use the daemon: the embedded run covers it")
    proc: DaemonProc = request.getfixturevalue("daemon")
    yield "daemon"  # offload_options routes the test's Offloaders to it
    gc.collect()  # Offloaders a test did not close end their sessions when collected
    doc = proc.wait_idle()
    assert not doc["sessions"], f"sessions left open: {doc['sessions']}"
    assert proc.held() == {"files": 0, "memfds": 0, "mappings": 0}
    assert held_descriptors(os.getpid(), [])["memfds"] == 0, "client kept a memfd"


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Let the interpreter switch threads after (almost) every bytecode."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """One intra-op thread for a module (``pytestmark = usefixtures(...)``): tiny tensors run
    fastest so, and immune to a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
