"""offloadd under torch.compile on a CUDA GPU (inductor's Triton kernels): bitwise against the
same compiled model run without offloadd, eager-first and compile-first, whole-model and
per-block, with CUDA graphs (``mode="reduce-overhead"``) and compiled autograd. Skipped without
a GPU; scripts/gpu_check.sh runs them where one is lent.

On CUDA a compiled region's saved tensors move when its forward returns (Note [emptied in the
graph] in offloadd/runtime/graph_ops.py says why the graph's own emptying is CPU only), so a
whole-model graph holds them until then: these tests check exactness and that bytes moved, and
print the GPU's peak beside the same run without offloadd for the record.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

from offloadd import Config, Offloader
from tests._support.helpers import assert_bitwise_equal
from tests.runtime.test_compile import Stack, _fresh_dynamo  # noqa: F401  (the autouse fixture too)

pytestmark = pytest.mark.cuda
ENGINE_PARAMS = ("default",)


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = Stack(4, d=256, h=1024).cuda()
    return model, copy.deepcopy(model)


def _inputs(n: int = 3, rows: int = 2048) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(rows, 256, device="cuda", generator=g) for _ in range(n)]


def _steps(
    run: Any, model: nn.Module, xs: list[torch.Tensor], off: Offloader | None
) -> tuple[list[list[torch.Tensor]], int]:
    """Losses and gradients of one SGD step per input, and the GPU's peak above the start."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = []
    for x in xs:
        opt.zero_grad(set_to_none=True)
        if off is None:
            y = run(x)
        else:
            with off:
                y = run(x)
        loss = y.square().mean()
        loss.backward()
        out.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
        opt.step()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - start


def _offloader(tier: str, disk_dir: Path, **kw: Any) -> Offloader:
    return Offloader(Config(tier=tier, ssd_dirs=[str(disk_dir)], min_bytes=4096, **kw))  # type: ignore[arg-type]


def _compare(
    tier: str, disk_dir: Path, *, order: str = "compiled-in-scope", **compile_kw: Any
) -> None:
    plain, mine = _pair()
    xs = _inputs()

    def compiled(model: nn.Module) -> Any:
        run = torch.compile(model, **compile_kw)
        if order == "compiled-first":  # compiled and run before offloadd's hooks are on
            run(xs[0]).sum().backward()
            model.zero_grad(set_to_none=True)
        return run

    want, peak_plain = _steps(compiled(plain), plain, xs, None)
    torch._dynamo.reset()
    off = _offloader(tier, disk_dir)
    got, peak = _steps(compiled(mine), mine, xs, off)
    off.synchronize()
    st = off.stats()
    off.close()
    print(
        f"\n{tier} {order} {compile_kw}: GPU peak above start {peak_plain >> 20} MiB plain, "
        f"{peak >> 20} MiB with offloadd; {st.summary()}"
    )
    assert_bitwise_equal(want, got)
    assert st.offloaded_bytes > 0


@pytest.mark.parametrize("tier", ["cpu", "ssd"])
def test_whole_model_inductor(tier: str, disk_dir: Path) -> None:
    _compare(tier, disk_dir)


def test_whole_model_compiled_before_the_hooks(disk_dir: Path) -> None:
    _compare("cpu", disk_dir, order="compiled-first")


def test_per_block_inductor(disk_dir: Path) -> None:
    plain, mine = _pair()
    for model in (plain, mine):
        for block in model.blocks:  # type: ignore[union-attr]
            block.compile()
    xs = _inputs()
    want, _ = _steps(plain, plain, xs, None)
    off = _offloader("cpu", disk_dir)
    got, _ = _steps(mine, mine, xs, off)
    st = off.stats()
    off.close()
    assert_bitwise_equal(want, got)
    assert st.offloaded_bytes > 0


def test_cuda_graphs_reduce_overhead(disk_dir: Path) -> None:
    """CUDA graphs (cudagraph trees): a replay writes its outputs, saved tensors included, into
    the graph's own pool again; offloadd's copies must be done with them before that."""
    _compare("cpu", disk_dir, mode="reduce-overhead")


def test_compiled_autograd(disk_dir: Path) -> None:
    plain, mine = _pair()
    xs = _inputs()

    def steps(model: nn.Module, off: Offloader | None) -> list[list[torch.Tensor]]:
        run = torch.compile(model)
        with torch._dynamo.config.patch(compiled_autograd=True):
            out, _ = _steps(run, model, xs, off)
        return out

    want = steps(plain, None)
    torch._dynamo.reset()
    off = _offloader("cpu", disk_dir)
    got = steps(mine, off)
    st = off.stats()
    off.close()
    assert_bitwise_equal(want, got)
    assert st.offloaded_bytes > 0
