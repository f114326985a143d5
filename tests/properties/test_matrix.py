"""The single-process rows of the composition matrix (docs/compose.md).

Each row trains a small model with and without offloadd, from the same seeds, and requires
bit-identical losses and gradients, and that offloadd moved something. The checkpointing rows
also pin down what offloadd sees there: the figures in docs/compose.md are the ones asserted
here. HF Trainer through Accelerate is tests/integrations/test_clients.py::test_transformers_gpt2_bert_t5.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwad
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from offloadd import Offloader
from offloadd.runtime import transforms
from tests._support.helpers import MakeOffloader, assert_bitwise_equal, train, train_and_compare

ENGINE_PARAMS = ("default",)  # composition, not I/O: the engine users get is enough
pytestmark = [
    pytest.mark.usefixtures("one_intra_op_thread"),
    # torch's forward AD scripts its decompositions at first use (torch/_decomp), not ours
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
]

B, D, H, BLOCKS, STEPS = 64, 128, 512, 3, 3
F32 = 4
_aten = torch.ops.aten


def _inputs(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(B, D, generator=gen)


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Dropout(0.1), nn.Linear(H, D))


# -- row 1: activation checkpointing ---------------------------------------------------------


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (_aten.mm.default, _aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _SacContexts:
    """``context_fn`` for selective checkpointing that remembers the caching modes it made, so
    a test can count the bytes SAC itself holds."""

    def __init__(self) -> None:
        self.modes: list[Any] = []

    def __call__(self) -> tuple[Any, Any]:
        caching, cached = create_selective_checkpoint_contexts(_save_matmuls)
        self.modes.append(caching)
        return caching, cached

    def held_bytes(self, among: set[int] | None = None) -> int:
        """Bytes of the tensors SAC's caches hold (only those at the data pointers ``among``)."""
        total = 0
        for mode in self.modes:
            for entries in mode.storage.values():
                for entry in entries.values():
                    for leaf in torch.utils._pytree.tree_leaves(entry):
                        value = getattr(leaf, "val", None)  # _VersionWrapper
                        if isinstance(value, torch.Tensor) and (
                            among is None or value.data_ptr() in among
                        ):
                            total += value.nbytes
        return total


class _Net(nn.Module):
    """An input layer, then ``BLOCKS`` blocks, each checkpointed as ``mode`` says."""

    def __init__(
        self, mode: str, sac: _SacContexts | None = None, inner: Offloader | None = None
    ) -> None:
        super().__init__()
        self.mode, self.sac, self.inner = mode, sac, inner
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(_block() for _ in range(BLOCKS))

    def _run_block(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if self.inner is None:
            return block(h)
        with self.inner:  # the Offloader entered inside the checkpointed function
            return block(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            fn = functools.partial(self._run_block, block)
            if self.mode == "none":
                h = fn(h)
            elif self.mode == "sac":
                ctx = self.sac if self.sac is not None else _SacContexts()
                h = checkpoint(fn, h, use_reentrant=False, context_fn=ctx)
            else:
                h = checkpoint(fn, h, use_reentrant=self.mode == "reentrant")
        return h


# Saved per step with checkpointing, as offloadd sees it: each block's input (the checkpoint
# saves it for its recomputation) and the two saves outside the blocks (the input layer's input,
# the loss's input), all B x D float32.
_CKPT_SEEN = (BLOCKS + 2) * B * D * F32
# Without checkpointing, also three B x H saves per block: GELU's input, Dropout's scaled noise
# (CPU dropout multiplies by it) and the second Linear's input.
_NONE_SEEN = _CKPT_SEEN + BLOCKS * 3 * B * H * F32
_SAC_HELD = BLOCKS * (B * H + B * D) * F32  # the two addmm outputs of each block


@pytest.mark.parametrize("mode", ["none", "reentrant", "non-reentrant", "sac"])
def test_checkpointing(make_offloader: MakeOffloader, mode: str, disk_dir: Path) -> None:
    """Outer scope, blocks checkpointed: checkpointing (any kind) runs the region's saves
    through its own hooks, so offloadd moves only each checkpoint's input; the recomputation in
    backward runs outside the scope."""
    st = train_and_compare(lambda: _Net(mode), _inputs, make_offloader(disk_dir))
    assert st.bytes_read + st.forwarded_bytes > 0, st.summary()
    expected = _NONE_SEEN if mode == "none" else _CKPT_SEEN
    assert st.offloaded_bytes == STEPS * expected, st.summary()
    assert st.saved_bytes == st.offloaded_bytes + st.kept_bytes


def test_selective_checkpointing_keeps_what_it_saves_out_of_reach(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """What SAC's policy saves (here the matmuls' outputs) is held by SAC's own cache, a dispatch
    mode below autograd: no saved-tensor hook sees it, so offloadd moves only the checkpoints'
    inputs. Each block's last matmul output is also the next block's input (or the loss's): the
    storage offloadd moves is then held by SAC's cache as well, until backward frees the graph
    (the recomputation stops before that matmul: nothing in the block saves its output)."""
    sac = _SacContexts()
    torch.manual_seed(0)
    model = _Net("sac", sac)
    inputs: list[int] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: inputs.append(a[0].data_ptr()))
    off = make_offloader(disk_dir)
    try:
        with off:
            out = model(_inputs(torch.Generator().manual_seed(1)))
            loss = out.square().mean()
        assert sac.held_bytes() == _SAC_HELD  # 480 KiB in memory, invisible to offloadd
        shared = sac.held_bytes(among={*inputs[1:], out.data_ptr()})
        assert shared == BLOCKS * B * D * F32  # 96 KiB of it: storages offloadd moves too
        off.synchronize()
        assert off.stats().saved_bytes == _CKPT_SEEN  # 160 KiB, all moved
        assert off.stats().offloaded_bytes == _CKPT_SEEN
        loss.backward()
        assert sac.held_bytes() == shared  # not consumed: held until the graph is freed
    finally:
        off.close()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_scope_inside_the_checkpointed_function(
    make_offloader: MakeOffloader, reentrant: bool, disk_dir: Path
) -> None:
    """``with off:`` inside the checkpointed function. Non-reentrant: offloadd's hooks are the
    innermost, so they take every save of the region and the checkpoint sees none: the blocks
    are offloaded instead of recomputed. Reentrant: forward runs under no_grad and saves nothing;
    backward's recomputation enters the scope and moves what it saves, to use it at once."""
    mode = "reentrant" if reentrant else "non-reentrant"
    expected = train(lambda: _Net(mode), _inputs, None)
    off = make_offloader(disk_dir)
    try:
        torch.manual_seed(0)
        loss = _Net(mode, inner=off)(_inputs(torch.Generator().manual_seed(1))).square().mean()
        off.synchronize()
        forward_bytes = off.stats().offloaded_bytes
        loss.backward()
        got = train(lambda: _Net(mode, inner=off), _inputs, None)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert_bitwise_equal(expected, got)
    if reentrant:
        assert forward_bytes == 0  # all of it is moved during backward
    else:
        assert forward_bytes == _NONE_SEEN - 2 * B * D * F32  # the blocks' activations
    assert st.offloaded_bytes > 0 and st.bytes_read + st.forwarded_bytes > 0, st.summary()


# -- row 2: autocast, GradScaler ----------------------------------------------------------------


def _train_amp(
    dtype: torch.dtype, scaled: bool, off: Offloader | None
) -> tuple[list[list[torch.Tensor]], list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.LayerNorm(H), nn.Linear(H, D))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # 2**24 overflows float16 gradients at first: the scaler skips step 1, steps at 2**23.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=1, enabled=scaled)
    gen = torch.Generator().manual_seed(1)
    out, scales = [], []
    for _ in range(STEPS):
        x = _inputs(gen)
        with off if off is not None else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=dtype):
                y = model(x)
            assert y.dtype == dtype
            loss = y.float().square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        out.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale() if scaled else 1.0)
        opt.zero_grad()
    return out, scales


# Moved per step under autocast (2-byte copies): the input (B x D), GELU's, LayerNorm's and the
# second Linear's inputs (B x H each), autocast's copy of the second weight (H x D: 128 KiB),
# and the loss's float32 input (B x D). 368 KiB, against 448 KiB in float32 without autocast.
_AMP_SEEN = (B * D + 3 * B * H + H * D) * 2 + B * D * F32

_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bits(steps: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Floating tensors as their bit patterns, so that NaN compares equal to the same NaN."""
    return [[t.view(_INT_OF[t.dtype]) if t.dtype in _INT_OF else t for t in s] for s in steps]


@pytest.mark.parametrize(
    ("dtype", "scaled"),
    [(torch.bfloat16, False), (torch.float16, True)],
    ids=["bf16", "fp16-scaler"],
)
def test_autocast(
    make_offloader: MakeOffloader, dtype: torch.dtype, scaled: bool, disk_dir: Path
) -> None:
    """CPU autocast (torch 2.13 has float16 on CPU, and ``GradScaler("cpu")``). The low-precision
    copy autocast makes of a weight for a matmul is a new tensor, not the parameter: offloadd
    moves it like an activation (the 512 x 128 weight's bfloat16 copy, 128 KiB a step)."""
    expected, expected_scales = _train_amp(dtype, scaled, None)
    off = make_offloader(disk_dir)
    try:
        got, scales = _train_amp(dtype, scaled, off)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert_bitwise_equal(_bits(expected), _bits(got))  # skipped steps' gradients hold inf/nan
    assert scales == expected_scales
    if scaled:  # in both runs: a step skipped on inf gradients, then a step taken
        assert scales[0] < 2.0**24 and scales[1] > scales[0], scales
    assert st.offloaded_bytes == STEPS * _AMP_SEEN, st.summary()
    assert st.bytes_read + st.forwarded_bytes > 0  # moved out and back


# -- row 3: gradient accumulation -----------------------------------------------------------------


def _train_accumulating(
    off: Offloader | None, forwards_first: bool, micro: int = 3
) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(_block(), _block())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        losses = []
        for _ in range(micro):
            with off if off is not None else contextlib.nullcontext():
                loss = model(_inputs(gen)).square().mean() / micro
            if forwards_first:
                losses.append(loss)
            else:
                loss.backward()
                losses.append(loss.detach())
        for loss in reversed(losses) if forwards_first else ():
            loss.backward()
        out.append(
            [torch.stack([x.detach() for x in losses])]
            + [p.grad.clone() for p in model.parameters()]
        )
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("forwards_first", [False, True], ids=["interleaved", "forwards-first"])
def test_gradient_accumulation(
    make_offloader: MakeOffloader, forwards_first: bool, disk_dir: Path
) -> None:
    """Three micro-batches per optimizer step, each forward in the scope; backward after each,
    or after all three forwards, newest first (a pipeline's order)."""
    expected = _train_accumulating(None, forwards_first)
    off = make_offloader(disk_dir)
    try:
        got = _train_accumulating(off, forwards_first)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert_bitwise_equal(expected, got)
    assert st.offloaded_bytes > 0 and st.bytes_read + st.forwarded_bytes > 0, st.summary()


# -- row 4: nn.DataParallel ---------------------------------------------------------------------


def test_data_parallel_on_cpu(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """Without a GPU, ``nn.DataParallel`` has no device ids and its forward calls the module on
    the caller's thread: this proves the wrapper composes (parameters, module hooks, state),
    not the replicas, scatter/gather or the threads, which need two GPUs
    (tests/runtime/test_threads_device.py::test_data_parallel_cpu_tier)."""

    def make() -> nn.Module:
        dp = nn.DataParallel(nn.Sequential(_block(), _block()))
        assert dp.device_ids == []
        return dp

    st = train_and_compare(make, _inputs, make_offloader(disk_dir))
    assert st.offloaded_bytes > 0 and st.bytes_read + st.forwarded_bytes > 0, st.summary()


# -- row 5: torch.func ----------------------------------------------------------------------------


def _func_setup() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
    params = {k: v.detach() for k, v in model.named_parameters()}
    return model, params, _inputs(torch.Generator().manual_seed(1))


def _refusing_transforms() -> Iterator[tuple[str, Callable[[], object]]]:
    model, params, x = _func_setup()

    def loss(p: dict[str, torch.Tensor], a: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (a,)).square().mean()

    yield "grad", lambda: torch.func.grad(loss)(params, x)
    yield "vjp", lambda: torch.func.vjp(lambda a: loss(params, a), x)[1](torch.tensor(1.0))
    yield "jacrev", lambda: torch.func.jacrev(lambda a: loss(params, a))(x)


def test_func_grad_vjp_jacrev_refused_never_silent(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """torch.func's own autograd transforms raise in a scope (torch refuses saved-tensor hooks
    under them), before any op ran; so does entering the scope inside them. The Offloader stays
    usable."""
    off = make_offloader(disk_dir)
    model, params, x = _func_setup()
    try:
        for name, call in _refusing_transforms():
            with pytest.raises(RuntimeError, match=r"torch\.func"), off:
                call()
            assert off.stats().saved_tensors == 0, name

        def scoped(p: dict[str, torch.Tensor]) -> torch.Tensor:
            with off:
                return torch.func.functional_call(model, p, (x,)).square().mean()

        with pytest.raises(RuntimeError, match=r"torch\.func"):
            torch.func.grad(scoped)(params)
        with off:  # still usable
            loss = nn.Sequential(_block())(x).square().mean()
        loss.backward()
        off.synchronize()
        assert off.stats().offloaded_bytes > 0
    finally:
        off.close()


def test_func_refusal_says_what_to_do(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """Both refusals are offloadd's TransformRefused, naming the remedy."""
    off = make_offloader(disk_dir)
    try:
        for name, call in _refusing_transforms():
            with pytest.raises(RuntimeError) as info, off:
                call()
            assert isinstance(info.value, transforms.TransformRefused), name
            assert "outside `with off:`" in str(info.value)
        model, params, x = _func_setup()

        def scoped(p: dict[str, torch.Tensor]) -> torch.Tensor:
            with off:
                return torch.func.functional_call(model, p, (x,)).sum()

        with pytest.raises(RuntimeError) as info:
            torch.func.grad(scoped)(params)
        assert isinstance(info.value, transforms.TransformRefused)
    finally:
        off.close()


def test_transforms_helper_recognises_torchs_refusal() -> None:
    """The helper against the real torch: ``refusal`` maps the error a transform raises under
    hooks, ``check_enter`` raises inside a transform, and both leave everything else alone."""
    params = _func_setup()[1]
    for name, call in _refusing_transforms():
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with pytest.raises(RuntimeError) as info, hooks:
            call()
        mapped = transforms.refusal(info.value)
        assert isinstance(mapped, transforms.TransformRefused), name
        assert "torch.func" in str(mapped) and "outside `with off:`" in str(mapped)
    assert transforms.refusal(RuntimeError("something else")) is None
    assert transforms.refusal(ValueError("don't yet support saved tensor hooks")) is None
    assert transforms.refusal(None) is None
    transforms.check_enter()  # no transform: nothing

    def inside(p: dict[str, torch.Tensor]) -> torch.Tensor:
        transforms.check_enter()
        return p["0.weight"].sum()

    with pytest.raises(transforms.TransformRefused, match="entered inside the transform"):
        torch.func.grad(inside)(params)
    with torch.autograd.graph.disable_saved_tensors_hooks("not torch's transforms"):
        transforms.check_enter()  # another reason: torch's own error will say it


def _vmap_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.func.vmap(model)(x.view(4, B // 4, D)).square().mean()


def _jvp_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = dict(model.named_parameters())
    out, tangent = torch.func.jvp(
        lambda a: torch.func.functional_call(model, params, (a,)), (x,), (torch.ones_like(x),)
    )
    return out.square().mean() + tangent.square().mean()


def _jacfwd_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = dict(model.named_parameters())
    rows = x[:2]  # a Jacobian per row: (2, D) -> (2, D, 2, D)
    jac = torch.func.jacfwd(lambda a: torch.func.functional_call(model, params, (a,)))(rows)
    return jac.square().mean()


def _forward_ad_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward-mode AD without torch.func: ``torch.autograd.forward_ad`` (forward over reverse)."""
    with fwad.dual_level():
        dual = fwad.make_dual(x, torch.ones_like(x))
        out, tangent = fwad.unpack_dual(model(dual))
        return out.square().mean() + tangent.square().mean()


def _functional_call_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = {k: v * 1.0 for k, v in model.named_parameters()}  # e.g. reparametrized weights
    return torch.func.functional_call(model, params, (x,)).square().mean()


def _functionalize_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.func.functionalize(model)(x).square().mean()


_PASSING: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "vmap": _vmap_step,
    "functional_call": _functional_call_step,
    "functionalize": _functionalize_step,
    "jvp": _jvp_step,
    "jacfwd": _jacfwd_step,
    "forward_ad": _forward_ad_step,
}
# Forward-mode AD saves a zero tensor (a weight's tangent) that pack once tried to move; see
# [zero tangents] in offloadd/runtime/transforms.py.


def _train_func(
    step: Callable[[nn.Module, torch.Tensor], torch.Tensor], off: Offloader | None
) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        x = _inputs(gen).requires_grad_()
        with off if off is not None else contextlib.nullcontext():
            loss = step(model, x)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        out.append([loss.detach(), x.grad, *grads])
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize(
    "name",
    [pytest.param(n) for n in _PASSING],
)
def test_func_transforms_that_compose(
    make_offloader: MakeOffloader, name: str, disk_dir: Path
) -> None:
    """vmap, functional_call, functionalize, jvp and jacfwd in the scope (and forward-mode AD
    without torch.func), backward outside: the tensors autograd saves under them reach pack as
    plain tensors, are moved, and come back exact."""
    expected = _train_func(_PASSING[name], None)
    off = make_offloader(disk_dir)
    try:
        got = _train_func(_PASSING[name], off)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert_bitwise_equal(expected, got)
    assert st.offloaded_bytes > 0 and st.bytes_read + st.forwarded_bytes > 0, st.summary()
