"""Writes to relayed weights that autograd cannot see (Note [write guard] in relay/slabs.py):
through ``.data``, through numpy, from torch's worker threads. In forward they raise naming the
weight, never leaving a stale value; inside ``resident()`` they are written back. A fault that
is not relay's still crashes as it would without relay."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import offloadd
from offloadd.relay import RelayError, slabs
from tests.relay.cases import (
    Layered,
    MakeRelayConfig,
    Strided,
    freeze_layers,
    same,
    square_loss,
    step,
)

pytestmark = pytest.mark.skipif(slabs._write_guard is None, reason="write guard not built")

WRITES: dict[str, Callable[[nn.Parameter], None]] = {
    "data in place": lambda w: w.data.mul_(2),
    "data assigned": lambda w: setattr(w, "data", w.data * 2),
    "numpy": lambda w: w.detach().numpy().__setitem__((0, 0), 1.0),
    # a kernel big enough to run on torch's worker threads: they fault, not the main thread
    "worker threads": lambda w: w.data.fill_(0.5),
}


@pytest.mark.parametrize("how", list(WRITES))
def test_writes_in_forward_raise(
    make_relay_config: MakeRelayConfig, how: str, disk_dir: Path
) -> None:
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered(d=256)), config=make_relay_config(disk_dir))
    lin = model.layers[1][1]
    handle = lin.register_forward_pre_hook(lambda m, args: WRITES[how](m.weight))
    with pytest.raises(RelayError, match=r"changed in place during forward: layers\.1\.1\.weight"):
        model(torch.randn(2, 16))
    handle.remove()
    assert type(lin.weight).__name__ == "RelayedWeight"  # swapped back, the store unchanged
    torch.manual_seed(0)
    ref = freeze_layers(Layered(d=256))
    x = torch.randn(3, 16)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


@pytest.mark.parametrize("how", ["data in place", "data assigned", "worker threads"])
def test_writes_inside_resident_are_kept(
    make_relay_config: MakeRelayConfig, how: str, disk_dir: Path
) -> None:
    torch.manual_seed(0)
    ref = freeze_layers(Layered(d=256))
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered(d=256)), config=make_relay_config(disk_dir))
    before = offloadd.relay_stats(model).written_bytes
    with offloadd.resident(model):
        pass
    assert offloadd.relay_stats(model).written_bytes == before  # nothing written: nothing back
    with offloadd.resident(model):
        WRITES[how](model.layers[2][3].weight)
    WRITES[how](ref.layers[2][3].weight)
    wrote = offloadd.relay_stats(model).written_bytes - before
    assert 0 < wrote < offloadd.relay_stats(model).relayed_bytes  # that group only
    x = torch.randn(3, 16)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


def test_a_write_by_the_kernel_inside_resident_is_kept(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """A system call writing into a weight (``readinto``; a gloo collective receives the same
    way) cannot fault into a guard (it failed with EFAULT, and a gloo broadcast hung): inside
    resident() nothing is guarded, and what changed is found by comparing with the store."""
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered(d=256)), config=make_relay_config(disk_dir))
    new = torch.randn(256 * 768)
    path = disk_dir / "new-weight"
    path.write_bytes(new.numpy().tobytes())
    before = offloadd.relay_stats(model).written_bytes
    try:
        with offloadd.resident(model), path.open("rb", buffering=0) as f:
            assert f.readinto(model.layers[2][1].weight.detach().numpy()) == new.nbytes
    finally:
        path.unlink()
    wrote = offloadd.relay_stats(model).written_bytes - before
    assert 0 < wrote < offloadd.relay_stats(model).relayed_bytes  # that group only
    assert torch.equal(model.state_dict()["layers.2.1.weight"].flatten(), new)
    offloadd.unrelay(model)


def _relayed_beside(
    config: offloadd.Config, caplog: pytest.LogCaptureFixture
) -> tuple[nn.Module, nn.Module]:
    """The same frozen ``Layered`` twice (one seed): as it is, and relayed, its warnings caught."""
    torch.manual_seed(0)
    ref = freeze_layers(Layered())
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="offloadd"):
        model = offloadd.relay(freeze_layers(Layered()), config=config)
    return ref, model


def test_without_the_guard_resident_writes_back(
    make_relay_config: MakeRelayConfig,
    disk_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Built without csrc/write_guard: one warning; resident() (never guarded) writes back what
    changed all the same."""
    monkeypatch.setattr(slabs, "_write_guard", None)
    monkeypatch.setattr(slabs, "_warned", [])
    ref, model = _relayed_beside(make_relay_config(disk_dir), caplog)
    assert "offloadd.relay._write_guard is not built" in caplog.text
    st = offloadd.relay_stats(model)
    with offloadd.resident(model):
        model.layers[0][1].weight.data.mul_(0.5)
    ref.layers[0][1].weight.data.mul_(0.5)
    wrote = offloadd.relay_stats(model).written_bytes - st.written_bytes
    assert 0 < wrote < st.relayed_bytes  # that group only
    x = torch.randn(3, 16)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


def test_a_slab_written_while_guarded_is_clean_when_taken_again() -> None:
    """A write through a weight goes ahead and is seen; the slab taken again shows what the
    next read puts in it, not that write (Note [write guard])."""
    pool = slabs.Slabs(keep=1)
    slab = pool.take(3 * 4096)
    ctypes.memset(pool.target(slab), 1, 3 * 4096)  # a read landing
    assert pool.guarded(slab) and int(slab[5000]) == 1
    slab[5000] = 2
    assert pool.written(slab) == 5000 and int(slab[5000]) == 2
    address = slab.data_ptr()
    del slab  # dropped written (a forward that raised)
    again = pool.take(3 * 4096)
    assert again.data_ptr() == address and pool.written(again) is None
    assert int(again[5000]) == 1  # the shared page again
    ctypes.memset(pool.target(again), 3, 3 * 4096)  # writable there: no EFAULT for a read
    assert int(again.min()) == 3 and pool.written(again) is None
    again[7] = 4
    assert pool.guard(again) and pool.written(again) == 7  # guarded again: still seen
    del again
    third = pool.take(3 * 4096)
    ctypes.memset(pool.target(third), 9, 3 * 4096)  # a read into it shows, whole
    assert third.data_ptr() == address and int(third[7]) == 9 and pool.written(third) is None


class Twice(Layered):
    """Its last layer runs twice in a forward; between the two, ``write`` runs."""

    write: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        if self.write is not None:
            self.write()
        return self.head(x + self.layers[-1](x))


def test_a_write_into_a_carried_slab_is_seen_and_not_kept(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """A write through a kept ``weight.data`` between two calls of one layer (its slab carried
    from the first to the second): the forward raises naming the weight, and the slab, taken by
    other groups later, shows what they read, not the write."""
    torch.manual_seed(0)
    ref = freeze_layers(Twice())
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Twice()), config=make_relay_config(disk_dir))
    last = model.layers[-1][1]
    kept: list[torch.Tensor] = []
    handle = last.register_forward_hook(lambda m, i, o: kept.append(m.weight.data))
    model.write = lambda: kept[0].add_(1.0)
    with pytest.raises(RelayError, match=r"layers\.3\.1\.weight"):
        model(torch.randn(3, 16, requires_grad=True)).sum().backward()
    handle.remove()
    model.write = ref.write = None
    kept.clear()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 16)
            assert torch.equal(model(x), ref(x))
    offloadd.unrelay(model)


def test_a_kept_storage_keeps_its_slab() -> None:
    """``untyped_storage()`` (or a TypedStorage) kept by anyone holds its slab: torch counts one
    storage object however many hold it, so the pool counts the object's references."""
    pool = slabs.Slabs(keep=1)
    h = pool.take(4096)
    ctypes.memset(pool.target(h), 1, 4096)
    storage = h.untyped_storage()
    del h
    again = pool.take(4096)
    assert again.data_ptr() != storage.data_ptr()
    del storage, again
    assert pool.live_bytes == 0


def test_without_memfd_slabs_are_unguarded(
    make_relay_config: MakeRelayConfig,
    disk_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A kernel that refuses memfd_create (seccomp, gVisor): relay runs, its slabs one private
    mapping each, unguarded, said once."""
    import errno

    def refused(*args: object) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refused)
    monkeypatch.setattr(slabs, "_warned", [])
    ref, model = _relayed_beside(make_relay_config(disk_dir), caplog)
    x = torch.randn(3, 16)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    assert caplog.text.count("cannot be mapped twice here (memfd_create") == 1
    offloadd.unrelay(model)


def test_a_finalizer_closing_the_pool_inside_a_take_returns() -> None:
    """A collection inside take (a new slab's allocations) may run relay's finalizer, which
    closes the pool: on the same thread, that must not wait on the lock take holds."""
    import gc
    import threading
    import weakref

    class Model:
        pass

    def attempt(threshold: int) -> bool:
        pool = slabs.Slabs(keep=1)

        def run() -> None:
            m = Model()
            m.me = m  # type: ignore[attr-defined]  # a dropped cycle, as a relayed model is
            weakref.finalize(m, pool.close)
            del m
            gc.set_threshold(threshold)
            try:
                pool.take(1 << 20)
            finally:
                gc.set_threshold(700)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(10)
        return not t.is_alive()

    assert all(attempt(k) for k in range(1, 60))


def test_a_new_data_over_the_same_bytes_is_seen(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """``w.data = w.data.t()`` on a square weight writes nothing and keeps its storage, offset
    and shape: only its strides say it changed."""
    torch.manual_seed(0)
    ref = Strided()
    torch.manual_seed(0)
    model = offloadd.relay(Strided(), config=make_relay_config(disk_dir))
    handle = model.register_forward_pre_hook(lambda m, args: setattr(m.a, "data", m.a.data.t()))
    with pytest.raises(RelayError, match=r"changed in place during forward: a\."):
        model(torch.randn(5, 96))
    handle.remove()
    with offloadd.resident(model):
        model.a.data = model.a.data.t()
    ref.a.data = ref.a.data.t()
    assert torch.equal(model.state_dict()["a"], ref.a)  # written back, not lost
    offloadd.unrelay(model)


def test_state_dict_inside_resident_sees_a_new_data(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """Inside resident() a weight given a new ``.data`` is that tensor: state_dict() says so, and
    loading that state_dict back keeps it."""
    model = offloadd.relay(freeze_layers(Layered(d=256)), config=make_relay_config(disk_dir))
    with offloadd.resident(model):
        w = model.layers[1][1].weight
        w.data = torch.zeros_like(w)
        sd = model.state_dict()
        assert torch.equal(sd["layers.1.1.weight"], w)
        model.load_state_dict(sd)
    assert not model.state_dict()["layers.1.1.weight"].any()
    offloadd.unrelay(model)


def test_a_write_names_only_the_weight_written(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """``a`` and ``b`` were views of one storage at offsets: a write into ``b`` names ``b``."""
    model = offloadd.relay(Strided(), config=make_relay_config(disk_dir))

    def write_b(m: nn.Module, args: object) -> None:
        m.b.data[3, 5] = 0

    handle = model.register_forward_pre_hook(write_b)
    with pytest.raises(RelayError, match=r"during forward: b\. "):
        model(torch.randn(5, 96))
    handle.remove()
    offloadd.unrelay(model)


def test_a_slab_that_cannot_be_guarded_stays_unguarded() -> None:
    """Every slot of the native module in use: the next slab is not guarded (relay then writes
    its group back from resident()), rather than install() failing half done."""
    pool = slabs.Slabs(keep=0)
    held = [pool.take(4096) for _ in range(slabs._write_guard.SLOTS + 1)]
    guarded = [pool.guard(s) for s in held]
    assert not guarded[-1] and guarded[0]
    held[-1][0] = 1  # writable
    assert pool.written(held[-1]) is None and pool.written(held[-1]) is None
    for s in held:
        pool.written(s)


def test_a_forked_child_writes_into_its_own_slabs() -> None:
    """A child forked while slabs are held (a DataLoader worker, a forked server) writing into
    its copy of a slab, guarded or idle in the pool, changes nothing in the parent's."""
    pool = slabs.Slabs(keep=1)
    idle = pool.take(2 * 4096)
    ctypes.memset(pool.target(idle), 1, 2 * 4096)
    address = idle.data_ptr()
    del idle
    guarded = pool.take(3 * 4096)
    ctypes.memset(pool.target(guarded), 1, 3 * 4096)
    assert pool.guard(guarded)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no torch kernels (its thread pool did not survive the fork)
        code = 1
        try:
            ctypes.memset(guarded.data_ptr(), 7, guarded.nbytes)
            taken = pool.take(2 * 4096)
            ctypes.memset(pool.target(taken), 7, 2 * 4096)
            os.read(r, 1)  # the parent has read into the slab this child holds
            code = 0 if ctypes.string_at(guarded.data_ptr(), 1) == b"\x07" else 2
        finally:
            os._exit(code)
    ctypes.memset(pool.target(guarded), 5, 3 * 4096)  # a read landing in the parent
    os.write(w, b"x")
    assert os.waitpid(pid, 0)[1] == 0
    assert int(guarded.max()) == 5 and pool.written(guarded) is None
    again = pool.take(2 * 4096)
    assert again.data_ptr() == address and int(again.max()) == 1


CRASH = """
import ctypes, faulthandler, os, signal, sys
import torch
import offloadd
from offloadd.config import Config
from tests.relay.cases import Layered, freeze_layers
if sys.argv[1] == "after":
    faulthandler.disable()
model = offloadd.relay(freeze_layers(Layered()), config=Config().replace(
    tier="ssd", ssd_dirs=(sys.argv[2],)))
if sys.argv[1] == "after":
    faulthandler.enable()  # replaces relay's handler: the next swap-in chains to it
model(torch.randn(2, 16))
def crash(m, args):
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGSEGV)
    ctypes.string_at(0)
model.layers[1].register_forward_pre_hook(crash)
model(torch.randn(2, 16))
"""


CODE = textwrap.dedent(CRASH)


@pytest.mark.parametrize("how", ["fault", "kill"])
@pytest.mark.parametrize("faulthandler_on", ["before", "after"])
def test_a_real_crash_still_crashes(how: str, faulthandler_on: str, disk_dir: Path) -> None:
    """A segfault that is not a guarded write, or a SIGSEGV sent by kill, reaches faulthandler
    (its traceback), then the default action: relay's handler never swallows it."""
    out = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", CODE, faulthandler_on, str(disk_dir), how],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == -11, out
    assert "Fatal Python error: Segmentation fault" in out.stderr
    assert "in crash" in out.stderr, out.stderr
