"""What users do with a relayed model between two training steps: load other weights, work
inside ``resident()``, convert it, evaluate it, save its state, clear its gradients. Most are
checked after a step with gradient checkpointing, which reads layers in on demand in backward
(Note [on demand] in relay/relayer.py), against the same model without relay: bit-identical
losses and gradients (Note [between steps])."""

from __future__ import annotations

import contextlib
import importlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offloadd
from offloadd.relay import RelayError
from offloadd.relay.state import state_of
from offloadd.relay.store import HostStore, WeightStore
from tests.relay.cases import (
    Layered,
    MakeRelayConfig,
    freeze_layers,
    llama,
    llama_loss,
    same,
    square_loss,
    step,
)


class Block(nn.Module):
    """A layer that checkpoints its MLP itself: the recomputation in backward calls the MLP, not
    the layer, so the layer's hooks do not run and its weights are read in on demand."""

    def __init__(self, d: int, reentrant: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.training and torch.is_grad_enabled():
            return x + checkpoint(self.mlp, h, use_reentrant=self.reentrant)  # type: ignore[operator]
        return x + self.mlp(h)


class Inner(nn.Module):
    """A residual stack of :class:`Block` s (frozen), a trainable input and head."""

    def __init__(self, reentrant: bool, layers: int = 4, d: int = 128) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.ModuleList(Block(d, reentrant) for _ in range(layers))
        self.layers.requires_grad_(False)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _llama(reentrant: bool) -> nn.Module:
    m = llama(4)
    m.gradient_checkpointing_enable({"use_reentrant": reentrant})
    return m


Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]
CASES: dict[str, tuple[Callable[[bool], nn.Module], Callable[[int], torch.Tensor], Loss]] = {
    "hf-llama": (
        _llama,
        lambda s: torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(s)),
        llama_loss,
    ),
    "checkpoint": (
        Inner,
        lambda s: torch.randn(6, 16, generator=torch.Generator().manual_seed(s)),
        square_loss,
    ),
}


def layers(m: nn.Module) -> nn.ModuleList:
    inner = m.model if case_of(m) == "hf-llama" else m
    return inner.layers  # type: ignore[return-value]


def case_of(m: nn.Module) -> str:
    return "checkpoint" if isinstance(m, Inner) else "hf-llama"


def build(case: str, reentrant: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = CASES[case][0](reentrant)
    m.train()
    return m


def use_store(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relay to ``store``: the ssd tier's, or the cpu tier's pinned records (which a CPU model
    gets only where a GPU is present: here it is given them)."""
    if store == "cpu" and not torch.cuda.is_available():
        surface = importlib.import_module("offloadd.relay.surface")
        monkeypatch.setattr(surface, "open_store", lambda cfg, device, largest=0: HostStore())


Stepped = tuple[nn.Module, nn.Module, Callable[[int], torch.Tensor], Loss]


@pytest.fixture
def stepped(
    make_relay_config: MakeRelayConfig,
    case: str,
    reentrant: bool,
    store: str,
    disk_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Stepped]:
    """The plain model and the relayed one after a training step with gradient checkpointing
    (the same losses and gradients), and the case's inputs and loss."""
    _, make_input, loss_of = CASES[case]
    use_store(store, monkeypatch)
    ref = build(case, reentrant)
    model = offloadd.relay(build(case, reentrant), config=make_relay_config(disk_dir, tier=store))
    kind = HostStore if store == "cpu" else WeightStore
    assert isinstance(state_of(model).relay.store, kind)
    assert same(step(ref, make_input(1), loss_of), step(model, make_input(1), loss_of))
    yield ref, model, make_input, loss_of
    offloadd.unrelay(model)


def eval_loss(m: nn.Module, x: torch.Tensor, loss_of: Loss) -> torch.Tensor:
    m.eval()
    try:
        with torch.no_grad():
            return loss_of(m, x)
    finally:
        m.train()


def assert_same_after(s: Stepped, seed: int = 2) -> None:
    """The next evaluation and training step of both models give the same bits."""
    ref, model, make_input, loss_of = s
    x = make_input(seed)
    assert torch.equal(eval_loss(ref, x, loss_of), eval_loss(model, x, loss_of))
    assert same(step(ref, x, loss_of), step(model, x, loss_of))


# the quick set: the plain model each way, HF's on the ssd tier (the cpu tier's store answers
# relay the same way: its HF runs are the slow siblings)
CASE = pytest.mark.parametrize(
    ("case", "reentrant", "store"),
    [
        pytest.param(
            case,
            reentrant,
            store,
            id=f"{case}-{'reentrant' if reentrant else 'non-reentrant'}-{store}",
            marks=[pytest.mark.slow]
            if store == "cpu" and (case != "checkpoint" or reentrant)
            else [],
        )
        for case in CASES
        for reentrant in (False, True)
        for store in ("ssd", "cpu")
    ],
)


@CASE
def test_nothing_stays_swapped_in_after_a_step(stepped: Stepped) -> None:
    """The one state between steps: no group swapped in (so no slab in use), whatever forward
    or backward read in on demand."""
    _, model, _, _ = stepped
    r = state_of(model).relay
    assert not r._installed and not r._on_demand and r.slabs.live_bytes == 0
    frozen = [p for p in layers(model).parameters() if not p.requires_grad]
    assert frozen and all(type(p).__name__ == "RelayedWeight" for p in frozen)


@CASE
def test_load_after_a_checkpointed_step(stepped: Stepped, case: str, reentrant: bool) -> None:
    """HF Trainer's ``load_best_model_at_end``: the best weights, saved and loaded back with
    ``strict=False``, are the ones the next evaluation and step use."""
    ref, model, _, _ = stepped
    buf = io.BytesIO()
    torch.save(build(case, reentrant, seed=5).state_dict(), buf)
    for m in (ref, model):
        buf.seek(0)
        missing, unexpected = m.load_state_dict(torch.load(buf), strict=False)
        assert not missing and not unexpected
    assert_same_after(stepped)


@CASE
def test_resident_after_a_checkpointed_step(stepped: Stepped, disk_dir: Path) -> None:
    """Inside ``resident()`` every weight is in memory and unguarded: a write through ``.data``
    and a system call writing into a weight both reach the next forward (docs/relay.md)."""
    ref, model, _, _ = stepped

    def two(m: nn.Module) -> list[nn.Parameter]:
        return [p for p in layers(m)[0].parameters() if p.dim() == 2][:2]  # backward ends with it

    new = torch.randn(two(model)[1].shape)
    path = disk_dir / "new-weight"
    path.write_bytes(new.numpy().tobytes())
    try:
        for m, scope in ((ref, contextlib.nullcontext), (model, offloadd.resident)):
            with scope(m):  # type: ignore[operator]
                a, b = two(m)
                with path.open("rb", buffering=0) as f:  # first: no fault made it writable
                    assert f.readinto(b.detach().numpy()) == new.nbytes
                a.data.mul_(2)
    finally:
        path.unlink()
    assert_same_after(stepped)


@CASE
def test_to_after_a_checkpointed_step(stepped: Stepped) -> None:
    ref, model, make_input, loss_of = stepped
    model.to("cpu")
    assert_same_after(stepped)
    model.double()
    ref.double()
    x = make_input(3)
    if x.is_floating_point():
        x = x.double()
    assert same(step(ref, x, loss_of), step(model, x, loss_of))


@CASE
def test_eval_between_checkpointed_steps(stepped: Stepped) -> None:
    assert_same_after(stepped, seed=2)
    assert_same_after(stepped, seed=3)


@CASE
def test_state_dict_after_a_checkpointed_step(stepped: Stepped) -> None:
    ref, model, _, _ = stepped
    want, got = ref.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def _after_a_backward_that_raised(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> tuple[nn.Module, nn.Module]:
    """The reference, and the relayed model after a checkpointed backward that raised, the
    groups it read in on demand still in (its callbacks never ran)."""
    ref = build("checkpoint", False)
    model = offloadd.relay(build("checkpoint", False), config=make_relay_config(disk_dir))

    def fail(grad: torch.Tensor) -> None:
        raise KeyError("in backward")

    handle = model.inp.register_forward_hook(lambda m, a, out: out.register_hook(fail) and None)
    with pytest.raises(KeyError, match="in backward"):
        square_loss(model, torch.randn(2, 16)).backward()
    handle.remove()
    assert state_of(model).relay._installed  # left in: the next operation's to settle
    return ref, model


def test_after_a_backward_that_raised(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """A backward that raised ends without its callbacks, so the groups it read in on demand
    stay in: the next load, conversion and ``resident()`` swap them out first."""
    ref, model = _after_a_backward_that_raised(make_relay_config, disk_dir)
    model.zero_grad(set_to_none=True)
    sd = build("checkpoint", False, seed=5).state_dict()
    for m in (ref, model):
        m.load_state_dict(sd)
    x = torch.randn(3, 16)
    assert torch.equal(eval_loss(ref, x, square_loss), eval_loss(model, x, square_loss))
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


def test_unrelay_after_a_backward_that_raised(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """``unrelay`` after a backward that raised: the groups it left in (swapped in, guarded)
    come back as plain weights, writable, with the store's values."""
    ref, model = _after_a_backward_that_raised(make_relay_config, disk_dir)
    offloadd.unrelay(model)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for p in model.parameters():
        p.data.add_(0)  # writable: no guard left on any page
    x = torch.randn(3, 16)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))


def test_a_write_in_backward_raises_as_backward_ends(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """A ``.data`` write into a weight read in on demand by backward's recomputation: backward
    raises naming it as it ends, nothing is left swapped in, and the store keeps the weights."""
    ref = build("checkpoint", False)
    model = offloadd.relay(build("checkpoint", False), config=make_relay_config(disk_dir))

    def write(m: nn.Module, args: object) -> None:
        if torch._C._current_graph_task_id() != -1:  # the recomputation
            m.weight.data.mul_(2)

    handle = model.layers[0].mlp[0].register_forward_pre_hook(write)
    with pytest.raises(RelayError, match=r"changed in place while the model ran: layers\.0\.mlp"):
        square_loss(model, torch.randn(2, 16)).backward()
    handle.remove()
    assert not state_of(model).relay._installed
    x = torch.randn(3, 16)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


def test_setting_grad_to_none(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """``p.grad = None`` over every parameter, the optimizer's ``zero_grad()`` either way, and
    ``del p.grad``: a relayed weight has no gradient to clear, and clearing it is no write. A
    gradient given to one, or a write to its values, still raises."""
    torch.manual_seed(0)
    ref = freeze_layers(Layered())
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, model)]
    x = torch.randn(3, 16)
    for clear in (
        lambda m, o: [setattr(p, "grad", None) for p in m.parameters()],
        lambda m, o: o.zero_grad(set_to_none=True),
        lambda m, o: o.zero_grad(set_to_none=False),
        lambda m, o: [delattr(p, "grad") for p in m.parameters()],
    ):
        for m, o in zip((ref, model), opts, strict=True):
            m(x).square().mean().backward()
            o.step()
            clear(m, o)
        assert [p.grad is None for p in ref.parameters()] == [
            p.grad is None for p in model.parameters()
        ]
        assert same(step(ref, x, square_loss), step(model, x, square_loss))
    w = model.layers[0][1].weight
    assert w.grad is None
    with pytest.raises(RelayError, match=r"'layers\.0\.1\.weight'.*frozen"):
        w.grad = torch.zeros(w.shape)
    with pytest.raises(RelayError, match=r"'layers\.0\.1\.weight'"):
        w.data.zero_()
    with pytest.raises(RelayError, match=r"'layers\.0\.1\.weight'"):
        w.mul_(2)
    offloadd.unrelay(model)
