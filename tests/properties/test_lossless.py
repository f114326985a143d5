"""Lossless capture: the bytes captured are the ones autograd would use, and nothing that
reaches the hooks crashes them (see [capture after the op] in offloadd/runtime/capture.py)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from offloadd import Offloader
from offloadd.io.python_engine import PythonEngine
from offloadd.runtime import capture
from tests._support.helpers import MakeOffloader, SavePayload, StagedEngine

pytestmark = pytest.mark.usefixtures("backend")
# What is captured, and when, does not depend on the engine: one embedded engine and the daemon.
ENGINE_PARAMS = ("native-threads",)

N = 256


def _close_released(off: Offloader) -> None:
    """Close ``off`` after checking that it holds nothing (its graphs are gone)."""
    off.synchronize()
    st = off.stats()
    off.close()
    assert st.resident_bytes == 0 and st.disk_bytes == 0


def _grads(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, off: object
) -> list[torch.Tensor]:
    """Gradient of ``fn`` at ``x`` (and its output), from a fixed RNG state."""
    x = x.detach().requires_grad_()
    torch.manual_seed(0)
    if off is None:
        y = fn(x)
    else:
        with off:  # type: ignore[attr-defined]
            y = fn(x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    (g,) = torch.autograd.grad((y * w).sum(), x)
    return [y.detach(), g]


def _rrelu(x: torch.Tensor) -> torch.Tensor:
    return F.rrelu(x * 1.5, lower=0.1, upper=0.3, training=True)


def _rrelu_inplace(x: torch.Tensor) -> torch.Tensor:
    return F.rrelu_(x * 1.5, lower=0.1, upper=0.3, training=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("fn", [_rrelu, _rrelu_inplace], ids=["rrelu", "rrelu_"])
@pytest.mark.parametrize("tier", ["ssd", "cpu"])
def test_rrelu_noise_filled_by_the_op(
    make_offloader: MakeOffloader,
    tier: str,
    fn: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
    disk_dir: Path,
) -> None:
    """rrelu saves ``noise`` before its kernel fills it (without a version bump): the bytes
    offloaded must be the ones after the kernel, as autograd sees them without hooks."""
    x = torch.randn(N, N, dtype=dtype)
    expected = _grads(fn, x, None)
    for min_bytes in (0, 4096):
        off = make_offloader(disk_dir, tier=tier, min_bytes=min_bytes)
        got = _grads(fn, x, off)
        st = off.stats()
        off.close()
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a, b)
        if tier == "ssd":
            assert st.offloaded_bytes >= N * N * dtype.itemsize


def test_same_node_packs_wait_for_the_op(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """Every pack of one op shares a node number; only a later node's pack captures them."""
    off = make_offloader(disk_dir, min_bytes=0)
    numbers: list[int] = []
    real_add = off.runtime.captures.add

    def add(item: object) -> None:
        numbers.append(capture.next_node_number())
        real_add(item)

    off.runtime.captures.add = add  # type: ignore[method-assign]
    x = torch.randn(N, N, requires_grad=True)
    with off:
        y = F.rrelu(x * 1.0, training=True)  # saves noise and self: one node
        assert off.runtime.captures.num_pending == 2
        z = y.sigmoid()  # saves its result: the next node captures rrelu's two
        assert off.runtime.captures.num_pending == 1
    assert off.runtime.captures.num_pending == 0
    assert numbers[0] == numbers[1] < numbers[2]
    z.sum().backward()
    off.close()


def test_without_node_numbers_everything_waits_for_the_scope(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch without the node counter: exact still, captured when the scope ends."""
    monkeypatch.setattr(capture, "_SEQUENCE_NR", None)
    x = torch.randn(N, N)
    expected = _grads(_rrelu, x, None)
    off = make_offloader(disk_dir, min_bytes=0)
    got = _grads(_rrelu, x, off)
    assert off.runtime.captures.num_pending == 0
    assert off.stats().offloaded_bytes >= 2 * N * N * 4
    off.close()
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_backward_before_capture_uses_the_tensor_itself(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """Backward inside the scope, before the last op's tensors were captured: they are used as
    they are (checked like kept ones) and never written."""
    x = torch.randn(N, N, requires_grad=True)
    expected = torch.autograd.grad(x.sin().sum(), x)[0]
    off = make_offloader(disk_dir)
    with off:
        z = x.sin()  # saves x: pending
        (g,) = torch.autograd.grad(z.sum(), x)
        y2 = x * 1
        z2 = y2.cos()  # saves y2: pending
        y2.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z2.sum().backward()
    st = off.stats()
    off.close()
    assert torch.equal(g, expected)
    assert st.bytes_written == 0 and st.offloaded_bytes == 0


class _Reuses(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2


def test_small_parameters_are_kept_but_not_resident(disk_dir: Path) -> None:
    """Parameters and their views below min_bytes (pack's lock-free path) count as saved and
    kept, but not as resident activation memory: the model holds them anyway."""
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=1 << 20)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with off:
        y = lin(x)  # saves x (an activation) and weight.t() (a view of a parameter)
        z = (y * lin.bias).sum()  # saves y and the bias itself
    st = off.stats()
    act, params = x.nbytes + y.nbytes, lin.weight.nbytes + lin.bias.nbytes
    assert st.saved_tensors == 4 and st.saved_bytes == st.kept_bytes == act + params
    assert st.resident_bytes == st.peak_resident_bytes == act
    z.backward()
    del y, z
    assert off.stats().resident_bytes == 0
    off.close()


def test_detached_leaves_are_activations_not_parameters(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """A leaf that requires grad is offloaded unless it is (a view of) a parameter or backs a
    module's parameter or buffer: reentrant checkpointing's detached inputs are such leaves."""
    off = make_offloader(disk_dir)
    lin = nn.Linear(N, N)
    x = torch.randn(N, N, requires_grad=True)
    with off:
        y = x.sin()  # saves x, a leaf that is no parameter
        z = SavePayload.apply(y, lin.weight)  # a parameter saved as itself
        w = lin(z)  # saves weight.t(), a view of a parameter
    st = off.stats()
    assert st.offloaded_bytes >= N * N * 4  # x
    assert st.kept_bytes >= 2 * N * N * 4  # the weight, twice
    w.sum().backward()
    off.close()

    # Reentrant checkpointing recomputes from detached leaves during backward; with backward
    # inside the scope, those leaves' saves come through offloadd and are moved.
    def run(off: object) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        m = _Reuses()
        x = torch.randn(N, N, requires_grad=True)
        if off is None:
            checkpoint(m, x, use_reentrant=True).sum().backward()
        else:
            with off:  # type: ignore[attr-defined]
                checkpoint(m, x, use_reentrant=True).sum().backward()
        return x, x.grad  # type: ignore[return-value]

    _, expected = run(None)
    off = make_offloader(disk_dir)
    _, got = run(off)
    st = off.stats()
    off.close()
    assert torch.equal(expected, got)
    assert st.offloaded_bytes >= N * N * 4


LAZY = {
    "LazyLinear": (lambda: nn.LazyLinear(32), (16, 64)),
    "LazyConv2d": (lambda: nn.LazyConv2d(8, 3), (2, 3, 16, 16)),
    "LazyConvTranspose1d": (lambda: nn.LazyConvTranspose1d(4, 3), (2, 3, 32)),
    "LazyBatchNorm1d": (lambda: nn.LazyBatchNorm1d(), (16, 64)),
    "LazyInstanceNorm2d": (lambda: nn.LazyInstanceNorm2d(affine=True), (2, 3, 8, 8)),
}


@pytest.mark.parametrize("name", sorted(LAZY))
def test_lazy_modules(make_offloader: MakeOffloader, name: str, disk_dir: Path) -> None:
    """Uninitialized parameters and buffers reach the module tracking: skipped, no crash; the
    gradients (first step materializes the module) are bit-identical."""
    make, shape = LAZY[name]

    def run(off: object) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m = make()
        x = torch.randn(*shape, requires_grad=True)
        for _ in range(2):
            if off is None:
                y = m(x)
            else:
                with off:  # type: ignore[attr-defined]
                    y = m(x)
            y.square().sum().backward()
        return [x.grad] + [p.grad for p in m.parameters()]  # type: ignore[list-item]

    expected = run(None)
    off = make_offloader(disk_dir, min_bytes=0)
    got = run(off)
    off.close()
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_meta_fake_and_subclass_tensors_pass_through(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """Tensors offloadd cannot or should not move reach the hooks: left untouched."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor

    off = make_offloader(disk_dir, min_bytes=0)
    # meta
    x = torch.randn(N, N, device="meta", requires_grad=True)
    with off:
        y = (x * 2).sin()
    y.sum().backward()
    assert x.grad is not None and x.grad.is_meta
    # fake
    with FakeTensorMode():
        f = torch.randn(N, N, requires_grad=True)
        with off:
            z = (f * 2).sin()
        z.sum().backward()
        assert f.grad is not None and f.grad.shape == (N, N)
    # a wrapper subclass (its inner tensors are what autograd's subclass dispatch saves)
    a, b = torch.randn(N, N), torch.randn(N, N)
    t = TwoTensor(a, b).requires_grad_()
    expected = torch.autograd.grad((t * 2).sin().sum(), t)[0]
    with off:
        u = (t * 2).sin()
    (g,) = torch.autograd.grad(u.sum(), t)
    assert torch.equal(g.a, expected.a) and torch.equal(g.b, expected.b)
    st = off.stats()
    off.close()
    assert st.resident_bytes == 0


def test_inplace_on_output_before_the_next_op(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """A saved output changed in place before anything else was saved: PyTorch's error, as
    without hooks."""

    def message(off: object, anomaly: bool) -> str:
        x = torch.randn(N, N, requires_grad=True)
        with off if off is not None else contextlib.nullcontext():  # type: ignore[attr-defined]
            y = x.exp()  # saves its result
            y.mul_(2)
        raised = pytest.raises(RuntimeError, match="modified by an inplace operation")
        with torch.autograd.set_detect_anomaly(anomaly, check_nan=False), raised as e:
            y.sum().backward()
        return str(e.value)

    off = make_offloader(disk_dir)
    for anomaly in (False, True):
        # PyTorch's words but for the node the tensor is an output of (see inplace_error), and
        # the hint it gives with anomaly detection on or off
        plain = message(None, anomaly).replace(", which is output 0 of ExpBackward0,", "")
        assert message(off, anomaly) == plain.replace(", which is output 0 of Exp,", "")
    off.close()


@pytest.mark.parametrize(
    ("tier", "min_bytes"),
    [("keep", 0), ("cpu", 0), ("ssd", 1 << 20), ("ssd", 0)],
    ids=["keep", "cpu", "ssd-small-kept", "ssd-moved"],
)
def test_saved_outputs_of_a_dropped_graph_are_released(
    make_offloader: MakeOffloader, tier: str, min_bytes: int, disk_dir: Path
) -> None:
    """exp() saves its own output. Holding that tensor (with its grad_fn) from the packed object
    would make a cycle through autograd's C++ graph that no garbage collector sees: a graph
    dropped without backward (a metric computed inside the block) would never be freed."""
    off = make_offloader(disk_dir, tier=tier, min_bytes=min_bytes)
    x = torch.rand(N, N, requires_grad=True)
    for _ in range(3):
        with off:
            x.exp()
        with off:
            y = x * 2
            y.sigmoid()  # its output is saved; held until captured, then captured
    _close_released(off)


def _raises_inplace(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        return True
    return False


def test_double_backward_before_capture_sees_inplace_changes(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """create_graph inside the block, before the saved output was captured: the double-backward
    graph is built on what unpack returned, which must share the saved tensor's version counter,
    so that a later in-place change still raises, as without hooks."""
    x = torch.randn(N, N, requires_grad=True)
    v = torch.randn(N, N, requires_grad=True)

    def run(off: object) -> bool:
        with off if off is not None else contextlib.nullcontext():  # type: ignore[attr-defined]
            z = x.exp()  # saves its result: pending
            (g,) = torch.autograd.grad(z, x, grad_outputs=v, create_graph=True)
            z.mul_(2)
        return _raises_inplace(lambda: torch.autograd.grad(g.sum(), v))

    assert run(None)
    off = make_offloader(disk_dir)
    assert run(off)
    off.close()


@pytest.mark.parametrize("case", ["foreach", "mul_self"])
def test_version_moved_by_the_op_itself_raises(
    make_offloader: MakeOffloader, case: str, disk_dir: Path
) -> None:
    """Some in-place ops create a node between their saves and their kernel (``a.mul_(a)``
    clones the original self; ``_foreach_mul_`` saves every element first), so the node number
    can capture a save before the kernel ran. The kernel bumps the version, and the version
    handle sees it at unpack: PyTorch's error, as without hooks, never stale bytes."""

    def body() -> torch.Tensor:
        a0 = torch.randn(N, N, requires_grad=True, generator=torch.Generator().manual_seed(0))
        b0 = torch.randn(N, N, requires_grad=True, generator=torch.Generator().manual_seed(1))
        a, b = a0 * 1.0, b0 * 1.0
        if case == "foreach":
            torch._foreach_mul_([a, b], [b, a])
            return torch.autograd.grad((a + b).sum(), [a0, b0])[0]  # type: ignore[no-any-return]
        a.mul_(a)
        return torch.autograd.grad(a.sum(), a0)[0]  # type: ignore[no-any-return]

    assert _raises_inplace(body)
    for min_bytes in (0, 4096):
        off = make_offloader(disk_dir, min_bytes=min_bytes)

        def scoped(off: object = off) -> torch.Tensor:
            with off:  # type: ignore[attr-defined]
                return body()

        assert _raises_inplace(scoped)
        off.close()


def test_inplace_by_another_thread_during_capture_raises(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """The version may move between capture's check and its copy (another thread): the version
    handle catches it at unpack."""
    x = torch.randn(N, N, requires_grad=True)
    y = x * 1.0
    off = make_offloader(disk_dir)
    real = off.runtime.writer.write_out

    def write_out(block: object, t: torch.Tensor) -> None:
        def change() -> None:
            with torch.no_grad():
                y.add_(100)  # bumps y's version

        worker = threading.Thread(target=change)
        worker.start()
        worker.join()
        real(block, t)  # type: ignore[arg-type]

    off.runtime.writer.write_out = write_out  # type: ignore[method-assign]
    with off:
        z = y.sin()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    off.close()


def test_block_freed_while_captured_is_not_joined(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """A block whose refs all died while another thread copied it out must not be found by
    dedup: a new save of the same tensor gets a block of its own."""
    x = torch.randn(N, N, requires_grad=True)
    expected = torch.autograd.grad(x.sin().sum(), x)[0]
    off = make_offloader(disk_dir)
    in_write, go = threading.Event(), threading.Event()
    real = off.runtime.writer.write_out

    def write_out(block: object, t: torch.Tensor) -> None:
        if threading.current_thread().name == "capturer":
            in_write.set()
            go.wait()
        real(block, t)  # type: ignore[arg-type]

    off.runtime.writer.write_out = write_out  # type: ignore[method-assign]
    box: dict[str, torch.Tensor] = {}

    def first() -> None:
        with off:
            box["y"] = x.sin()  # captured at __exit__, held in write_out

    t = threading.Thread(target=first, name="capturer")
    t.start()
    in_write.wait()
    del box["y"]
    gc.collect()
    with off:
        y2 = x.sin()  # drains the free of the first block: dedup must not join it
    go.set()
    t.join()
    (g,) = torch.autograd.grad(y2.sum(), x)
    assert torch.equal(g, expected)
    del y2
    _close_released(off)


@pytest.mark.parametrize("in_place", [True, False])
def test_interrupt_during_capture_settles_the_block(
    make_offloader: MakeOffloader, in_place: bool, disk_dir: Path
) -> None:
    """A KeyboardInterrupt while capture waits for a staging slot (in place: for room among the
    sources held) propagates, and the block is settled (kept in memory): backward still works,
    nothing leaks, nothing hangs."""
    x = torch.randn(N, N, requires_grad=True)
    expected = torch.autograd.grad(x.sin().sum(), x)[0]
    off = make_offloader(disk_dir, io_engine=PythonEngine(2) if in_place else StagedEngine(2))
    writer = off.runtime.writer.in_place
    assert (writer is not None) == in_place
    owner: object = writer if writer is not None else off.runtime.writer
    name = "_wait_room" if writer is not None else "_acquire_slot"
    real = getattr(owner, name)
    calls = [0]

    def wait(arg: object) -> object:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return real(arg)

    setattr(owner, name, wait)
    with pytest.raises(KeyboardInterrupt), off:
        y = x.sin()  # saves x: pending
        y.exp()  # a later node: captures x, interrupted
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, expected)
    del y
    _close_released(off)
