"""offloadd.relay where models reach their weights in unusual ways, and where autograd runs
in unusual orders: each case bit-identical to the model without relay, with what relay holds
still bounded by its window."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offloadd
from offloadd.config import Config
from offloadd.relay import RelayError, surface
from offloadd.relay.slabs import Slabs
from offloadd.relay.state import state_of
from offloadd.relay.store import HostStore, Record, Transfer
from offloadd.tools.models.sac import sac_context
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


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing(
    make_relay_config: MakeRelayConfig, reentrant: bool, disk_dir: Path
) -> None:
    """transformers recomputes a checkpointed layer by calling its forward directly: relay's
    hooks do not run, and the weights are read in on demand (Note [on demand])."""
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))

    def build() -> nn.Module:
        torch.manual_seed(0)
        m = llama(4)
        m.gradient_checkpointing_enable({"use_reentrant": reentrant})
        m.train()
        return m

    want = [step(m := build(), ids, llama_loss) for _ in range(2)]
    del m
    model = offloadd.relay(build(), config=make_relay_config(disk_dir))
    got = [step(model, ids, llama_loss) for _ in range(2)]
    assert all(same(a, b) for a, b in zip(want, got, strict=True))
    offloadd.unrelay(model)


class Shapes(nn.Module):
    """Weights reached other ways: a ModuleList of ModuleLists (iterated, never called), one
    frozen module used by two layers, a standalone MultiheadAttention (its out_proj's forward
    never runs), a complex weight used through conj()."""

    def __init__(self) -> None:
        super().__init__()
        d = 128
        shared = nn.Linear(d, d)
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.Linear(d, d), nn.Sequential(nn.GELU(), nn.Linear(d, d))])
            for _ in range(3)
        )
        self.pair = nn.ModuleList([nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared)])
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.cw = nn.Parameter(torch.randn(d, d, dtype=torch.complex64))
        self.head = nn.Linear(d, 2)
        for m in (self.layers, self.pair, self.attn):
            m.requires_grad_(False)
        self.cw.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a, b in self.layers:
            x = x + b(a(x))
        for layer in self.pair:
            x = layer(x)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        x = (x.to(torch.complex64) @ self.cw.conj()).real
        return self.head(x)


def test_weights_reached_other_ways(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    x = torch.randn(2, 5, 128)
    torch.manual_seed(0)
    want = step(Shapes(), x, square_loss)
    torch.manual_seed(0)
    model = offloadd.relay(Shapes(), config=make_relay_config(disk_dir))
    st = offloadd.relay_stats(model)
    # one module in two layers: kept, named by its first place only
    assert {"pair.0.0.weight", "pair.0.0.bias"} <= set(st.kept)
    assert not {"pair.1.0.weight", "pair.1.0.bias"} & set(st.kept)
    assert type(model.attn.out_proj.weight).__name__ == "RelayedWeight"
    assert type(model.layers[1][1][1].weight).__name__ == "RelayedWeight"
    for _ in range(2):
        assert same(want, step(model, x, square_loss))
    offloadd.unrelay(model)


_TAKE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "itself": lambda b: b,
    "float": lambda b: b.float(),  # the weight itself again: already float32
    "view": lambda b: b[:],
    "contiguous": lambda b: b.contiguous(),
}


class Mixed(Layered):
    """A parent that takes a weight of every layer in one op (a ``torch.cat`` of their biases),
    more groups than the relay's window, each bias as it is or through an op of its own."""

    def __init__(self, take: str = "itself") -> None:
        super().__init__()
        self.take = _TAKE[take]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        biases = [self.take(layer[1].bias) for layer in self.layers]  # type: ignore[index]
        return y + torch.cat(biases).mean()


@pytest.mark.parametrize("take", list(_TAKE))
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_an_op_taking_more_groups_than_the_window(
    make_relay_config: MakeRelayConfig, grad: bool, take: str, disk_dir: Path
) -> None:
    """Each placeholder of the op is read in on demand: all of them must be there when it runs
    (the window is kept once it has run), not the first ones swapped out by the last ones; an
    op that gives the weight back (``.float()`` of a float32 weight, a view) gives a tensor
    that stays what it was after the window moved on."""
    x = torch.randn(3, 16)
    torch.manual_seed(0)
    ref = freeze_layers(Mixed(take))
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Mixed(take)), window=2, config=make_relay_config(disk_dir))
    if grad:
        assert same(step(ref, x, square_loss), step(model, x, square_loss))
    else:
        with torch.no_grad():
            assert torch.equal(ref(x), model(x))
    r = state_of(model).relay
    assert not r._installed and not r._on_demand
    offloadd.unrelay(model)


def test_assigned_weight_is_refused(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    model.layers[1][1].weight = nn.Parameter(torch.zeros(384, 128), requires_grad=False)
    with pytest.raises(RelayError, match=r"layers\.1\.1\.weight.*replaced"):
        model(torch.randn(2, 16))
    del model.layers[1][1]._parameters["weight"]


def test_forward_inside_resident(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    torch.manual_seed(0)
    ref = freeze_layers(Layered())
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    x = torch.randn(3, 16)
    with offloadd.resident(model):
        assert same(step(ref, x, square_loss), step(model, x, square_loss))
        assert type(model.layers[0][1].weight) is nn.Parameter  # still in after forward
        with torch.no_grad():
            model.layers[0][1].weight.mul_(0.5)
            ref.layers[0][1].weight.mul_(0.5)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


def _held_peak(model: nn.Module, run: object) -> int:
    offloadd.relay_stats(model, reset_peak=True)
    run()  # type: ignore[operator]
    return offloadd.relay_stats(model).peak_resident_bytes


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layers_keep_the_window(
    make_relay_config: MakeRelayConfig, reentrant: bool, disk_dir: Path
) -> None:
    class Ckpt(Layered):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for layer in self.layers:
                x = x + checkpoint(layer, x, use_reentrant=reentrant)
            return self.head(x)

    x = torch.randn(4, 16)
    torch.manual_seed(0)
    want = step(freeze_layers(Ckpt(layers=8)), x, square_loss)
    torch.manual_seed(0)
    model = offloadd.relay(
        freeze_layers(Ckpt(layers=8)), window=2, config=make_relay_config(disk_dir)
    )
    got: list[object] = []
    peak = _held_peak(model, lambda: got.append(step(model, x, square_loss)))
    assert same(want, got[0])  # type: ignore[arg-type]
    st = offloadd.relay_stats(model)
    assert peak <= 4 * st.relayed_bytes // st.groups, (peak, st)
    offloadd.unrelay(model)


def test_selective_checkpointing_never_meets_relays_own_ops(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """A selective checkpoint records every op of its region in forward and replays the list op
    for op in the recompute (torch 2.13), raising at one it did not record. Relay's pre-hook
    runs inside the region, and makes a slab's views the first time the slab holds a layout:
    in forward or in the recompute, not both. Its work runs with the modes set aside (Note
    [below dispatch modes] in runtime/compiled.py); before, this raised "aten.empty... not
    found in storage" in the first step's backward."""

    class Sac(Layered):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for layer in self.layers:
                x = x + checkpoint(layer, x, use_reentrant=False, context_fn=sac_context)
            return self.head(x)

    x = torch.randn(4, 16)
    torch.manual_seed(0)
    plain = freeze_layers(Sac(layers=6))
    want = [step(plain, x, square_loss) for _ in range(3)]
    torch.manual_seed(0)
    model = offloadd.relay(
        freeze_layers(Sac(layers=6)), window=2, config=make_relay_config(disk_dir)
    )
    got = [step(model, x, square_loss) for _ in range(3)]
    assert all(same(a, b) for a, b in zip(want, got, strict=True))
    assert offloadd.relay_stats(model).read_bytes > 0
    offloadd.unrelay(model)


def test_two_forwards_one_backward(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """Summed micro-batches: each forward's refs hold their own slab, not every layer."""
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def two(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return square_loss(m, xs[0]) + square_loss(m, xs[1])

    torch.manual_seed(0)
    want = step(freeze_layers(Layered(layers=8)), xs[0], two)
    torch.manual_seed(0)
    model = offloadd.relay(
        freeze_layers(Layered(layers=8)), window=2, config=make_relay_config(disk_dir)
    )
    got: list[object] = []
    peak = _held_peak(model, lambda: got.append(step(model, xs[0], two)))
    assert same(want, got[0])  # type: ignore[arg-type]
    st = offloadd.relay_stats(model)
    assert peak <= 4 * st.relayed_bytes // st.groups, (peak, st)
    offloadd.unrelay(model)


def test_reads_once_where_once_is_enough(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """state_dict() reads each group once; a conversion that changes nothing reads nothing;
    one that changes the dtype holds one group at a time and stays exact."""
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    st = offloadd.relay_stats(model)
    model.state_dict()
    read = offloadd.relay_stats(model).read_bytes - st.read_bytes
    assert read <= st.written_bytes, (read, st)
    before = offloadd.relay_stats(model, reset_peak=True)
    model.to(torch.float32).cpu().float()
    after = offloadd.relay_stats(model)
    assert after.read_bytes == before.read_bytes and after.written_bytes == before.written_bytes
    model.double()
    assert offloadd.relay_stats(model).peak_resident_bytes <= 4 * st.relayed_bytes // st.groups
    torch.manual_seed(0)
    ref = freeze_layers(Layered()).double()
    x = torch.randn(2, 16, dtype=torch.float64)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


def test_dropped_without_collection(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """No reference cycle keeps a dropped relayed model (and its store's threads) alive."""
    before = threading.active_count()
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    step(model, torch.randn(2, 16), square_loss)
    del model
    assert threading.active_count() <= before


def test_retained_graph_backward_twice(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """A second backward through a retained graph unpacks every saved weight again: the same
    gradients as without relay, each group read once, not once per saved view."""
    x = torch.randn(3, 16)

    def twice(m: nn.Module) -> list[torch.Tensor]:
        loss = square_loss(m, x)
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]

    torch.manual_seed(0)
    want = twice(freeze_layers(Layered(layers=6)))
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered(layers=6)), config=make_relay_config(disk_dir))
    before = offloadd.relay_stats(model, reset_peak=True)
    got = twice(model)
    after = offloadd.relay_stats(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    group = before.written_bytes // 6
    assert after.read_bytes - before.read_bytes == (3 * 6 - 2) * group  # fwd, bwd, bwd again
    assert after.peak_resident_bytes <= 2 * group
    offloadd.unrelay(model)


def test_detach_refused_after_a_state_dict_that_raised(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """detach() of a relayed weight is let through only while its module saves it into a
    state_dict(): one that raised half-way (a child's hook, a read that failed) leaves it
    refused, so DDP's broadcast cannot skip the weight silently afterwards."""

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(256, 128), requires_grad=False)  # relayed
            self.child = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.child(x) + self.table[:1, :4]

    model = offloadd.relay(Root(), config=make_relay_config(disk_dir))
    placeholder = model._parameters["table"]

    def fail(*args: object) -> None:
        raise KeyError("child")

    handle = model.child.register_state_dict_pre_hook(fail)
    with pytest.raises(KeyError):
        model.state_dict()
    handle.remove()
    with pytest.raises(RelayError, match=r"'table'.*DistributedDataParallel"):
        placeholder.detach()
    assert torch.equal(model.state_dict()["table"], offloadd.unrelay(model).table)


class _Turned(Layered):
    """Its layers in order, or in reverse once ``backwards`` is set (a model that picks its
    path)."""

    backwards = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in reversed(self.layers) if self.backwards else self.layers:
            x = x + layer(x)
        return self.head(x)


def _turned_around(window: int, config: Config, x: torch.Tensor) -> tuple[_Turned, nn.Module, int]:
    """The plain model and the relayed one, stepped in order and then in reverse (the same
    losses and gradients), the relay's peak from the reversed step only; and a group's bytes.
    Held at that peak: ``window`` groups, and the reads started for the last order (up to
    ``window`` of them, until they land)."""
    torch.manual_seed(0)
    plain = freeze_layers(_Turned(layers=8))
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(_Turned(layers=8)), window=window, config=config)
    group = offloadd.relay_stats(model).written_bytes // 8
    assert same(step(plain, x, square_loss), step(model, x, square_loss))
    plain.backwards = model.backwards = True
    offloadd.relay_stats(model, reset_peak=True)
    assert same(step(plain, x, square_loss), step(model, x, square_loss))
    assert offloadd.relay_stats(model).peak_resident_bytes <= 2 * window * group
    return plain, model, group


@pytest.mark.parametrize("window", [1, 2, 3])
def test_a_forward_in_another_order_keeps_the_window(
    make_relay_config: MakeRelayConfig, window: int, disk_dir: Path
) -> None:
    """A forward that runs the layers in another order than the last one (routing, a model
    that picks its path) reads ahead for places it has passed: those reads are dropped, and
    what forward carries into backward is trimmed, so relay holds about ``window`` groups (the
    reads started for the old order land first), not every group."""
    x = torch.randn(3, 16)
    plain, model, group = _turned_around(window, make_relay_config(disk_dir), x)
    offloadd.relay_stats(model, reset_peak=True)  # the order is the last forward's again
    assert same(step(plain, x, square_loss), step(model, x, square_loss))
    # window groups, and the idle slab the dropped reads left warm (Note [slabs]: keep)
    assert offloadd.relay_stats(model).peak_resident_bytes <= (window + 1) * group
    offloadd.unrelay(model)


class _LandsLate(HostStore):
    """The host store, but the first read of each model forward stays in flight, its slab
    held, until the next forward begins: the read a forward starts for the last one's order
    lands after that forward has run its other layers (a disk behind, a loaded machine)."""

    def __init__(self) -> None:
        super().__init__()
        self.flying: list[torch.Tensor] = []
        self.first = False

    def begin_step(self) -> None:
        self.flying.clear()
        self.first = True

    def read(self, record: Record, slabs: Slabs, device: torch.device | None = None) -> Transfer:
        t = super().read(record, slabs, device)
        if self.first:
            self.first = False
            assert t.slab is not None
            self.flying.append(t.slab)
        return t


@pytest.mark.parametrize("window", [1, 2])
def test_a_forward_in_another_order_makes_room_before_each_read(
    make_relay_config: MakeRelayConfig, window: int, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What forward carries is trimmed before a layer's read, not after it: with a read
    started for the last forward's order still in flight, relay holds ``window`` groups and
    the reads for that order. (Trimmed after, it held a carried group more whenever such a
    read landed late: test_a_forward_in_another_order_keeps_the_window failed so under load.)"""
    monkeypatch.setattr(surface, "open_store", lambda cfg, device, largest=0: _LandsLate())
    _, model, _ = _turned_around(window, make_relay_config(disk_dir), torch.randn(3, 16))
    offloadd.unrelay(model)


@pytest.mark.parametrize("window", [1, 2])
def test_a_layer_called_again_takes_the_slab_forward_carries(
    make_relay_config: MakeRelayConfig, window: int, disk_dir: Path
) -> None:
    """The last layer called twice in a row (a weight used at two places): its second call
    swaps in the slab forward carries for backward, not a second read of it beside that one,
    so what relay holds stays ``window`` groups."""

    class Again(Layered):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for layer in [*self.layers, self.layers[-1]]:
                x = x + layer(x)
            return self.head(x)

    x = torch.randn(3, 16)
    torch.manual_seed(0)
    plain = freeze_layers(Again(layers=6))
    torch.manual_seed(0)
    model = offloadd.relay(
        freeze_layers(Again(layers=6)), window=window, config=make_relay_config(disk_dir)
    )
    assert same(step(plain, x, square_loss), step(model, x, square_loss))
    before = offloadd.relay_stats(model, reset_peak=True)
    assert same(step(plain, x, square_loss), step(model, x, square_loss))
    after = offloadd.relay_stats(model)
    group = before.written_bytes // 6
    assert after.read_bytes - before.read_bytes == (2 * 6 - window) * group
    assert after.peak_resident_bytes <= window * group
    offloadd.unrelay(model)


def test_a_write_in_a_second_call_leaves_the_first_calls_weights(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """A layer called twice, its weight written through .data in the second call: that forward
    raises, and the first call's graph, kept by the caller, still gets the stored weights in
    backward (the slab forward carried for it was the one written: it is not used)."""

    class Twice(Layered):
        kept: torch.Tensor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for layer in self.layers:
                x = x + layer(x)
            self.kept = x
            return self.head(x + self.layers[-1](x))

    x = torch.randn(3, 16)
    torch.manual_seed(0)
    plain = freeze_layers(Twice(layers=4))
    plain(x)
    plain.kept.square().sum().backward()
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Twice(layers=4)), config=make_relay_config(disk_dir))
    step(model, x, square_loss)  # the order: the last layer carried
    model.zero_grad(set_to_none=True)
    calls = []

    def write_in_second_call(module: nn.Module, args: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            module[1].weight.data.mul_(2)

    model.layers[-1].register_forward_pre_hook(write_in_second_call)
    with pytest.raises(RelayError, match=r"layers\.3\.1\.weight"):
        model(x)
    model.kept.square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None) and (
            a.grad is None or torch.equal(a.grad, b.grad)
        ), name


def test_backward_bookkeeping_stays_flat_over_steps(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """Backward's refs are kept per group and forward: a key whose refs are all unpacked is
    forgotten, so neither memory nor each forward's look over them grows with the steps."""
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), window=2, config=make_relay_config(disk_dir))
    saved = state_of(model).relay.saved
    x = torch.randn(2, 16)
    for _ in range(20):
        step(model, x, square_loss)
    assert not saved._pending and not saved._held and not saved._bwd, saved._pending
    offloadd.unrelay(model)


def test_layers_called_without_the_model(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """A loop that calls the relayed model's layers itself, never the model (an inner model
    of a wrapper called directly): the same gradients, and nothing kept grows with the steps
    (the order of the last forward is learned from the model's forwards only)."""

    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = m.inp(x)
        for layer in m.layers:
            h = h + layer(h)
        return m.head(h).square().mean()

    torch.manual_seed(0)
    plain = freeze_layers(Layered())
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), window=2, config=make_relay_config(disk_dir))
    for _ in range(10):
        x = torch.randn(2, 16)
        run(plain, x).backward()
        run(model, x).backward()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None) and (
            a.grad is None or torch.equal(a.grad, b.grad)
        )
    assert len(state_of(model).relay._seen) == 0
    offloadd.unrelay(model)


def test_hook_pair_follows_the_hooks_below(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """The pack/unpack pair a forward makes once (Note [hooks made once a forward] in
    relay/backward.py) passes each forward's other tensors to the hooks below it then, not to
    those of an earlier forward, and is not kept after the forward ends."""
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    want = step(freeze_layers(Layered()), x, square_loss)
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    saved = state_of(model).relay.saved
    seen: dict[str, int] = {"a": 0, "b": 0}

    def counting(name: str) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[name] += 1
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    for name in ("a", "b"):
        with counting(name):
            loss = square_loss(model, x.detach().requires_grad_(True))
        assert saved._made is None  # dropped as the forward ended
        loss.backward()
    assert seen["a"] == seen["b"] > 0  # each forward's tensors went to its own hooks below
    model.zero_grad(set_to_none=True)
    assert same(want, step(model, x, square_loss))
    offloadd.unrelay(model)


@pytest.mark.parametrize("window", [1, 2])
def test_a_layer_listed_twice_is_one_group(
    make_relay_config: MakeRelayConfig, window: int, disk_dir: Path
) -> None:
    """ALBERT-style sharing, ``ModuleList([a, b, c, a, b, c])``: each shared layer is one group,
    named by its first place, relayed once and called twice a step (the second entry of a
    module reached twice once made relay raise that its weight 'was replaced')."""

    def shared() -> nn.Module:
        torch.manual_seed(0)
        m = Layered(layers=3)
        m.layers = nn.ModuleList([*m.layers, *m.layers])
        return freeze_layers(m)

    model = offloadd.relay(shared(), window=window, config=make_relay_config(disk_dir))
    stats = offloadd.relay_stats(model)
    assert stats.groups == 3 and not stats.kept
    names = [g.name for g in state_of(model).relay.groups]
    assert names == ["layers.0", "layers.1", "layers.2"]
    plain = shared()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(3, 16, generator=g)
        assert same(step(plain, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)
    assert all(
        torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True)
    )


_FORKED = """
import multiprocessing as mp, sys
import torch
import offloadd
from offloadd.config import Config
from tests.relay.cases import Layered, freeze_layers
torch.set_num_threads(1)
model = offloadd.relay(freeze_layers(Layered()), config=Config().replace(
    tier="ssd", ssd_dirs=(sys.argv[1],)))
x = torch.randn(2, 16)
with torch.no_grad():
    want = model(x)

def child(q):
    try:
        with torch.no_grad():
            model(x)
        q.put("no error")
    except offloadd.RelayError as e:
        q.put(str(e))

ctx = mp.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=child, args=(q,))
p.start()
said = q.get(timeout=60)
p.join(60)
with torch.no_grad():
    assert torch.equal(model(x), want)  # the parent's model as it was
print(p.exitcode, said)
"""


def test_a_forked_child_is_refused_not_hung(disk_dir: Path) -> None:
    """A relayed model called in a child forked from its process: its store's I/O threads are
    the parent's, so its reads used to wait forever; now the child gets a RelayError saying so,
    and the parent's model works on."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _FORKED, str(disk_dir)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    code, said = done.stdout.strip().split(" ", 1)
    assert code == "0" and "used in a forked child" in said and "'spawn'" in said, said


def test_a_load_into_a_module_inside_a_layer(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """``model.layers[1][1].load_state_dict(...)``: one projection of a layer loaded (PEFT's
    merging, swapping one head). It raised from inside torch's copy (the group's hooks were on
    the layer only); now it loads as into the layer, and a load into the layer writes its group
    once, not once a module."""
    torch.manual_seed(0)
    plain = freeze_layers(Layered())
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    new = {k: torch.full_like(v, 0.02) for k, v in plain.layers[1][1].state_dict().items()}
    for m in (plain, model):
        m.layers[1][1].load_state_dict(new)  # type: ignore[index]
    before = offloadd.relay_stats(model).written_bytes
    whole = {k: v * 0.5 for k, v in plain.layers[2].state_dict().items()}
    for m in (plain, model):
        m.layers[2].load_state_dict(whole)  # type: ignore[index]
    group = offloadd.relay_stats(model).relayed_bytes // 4
    assert offloadd.relay_stats(model).written_bytes - before <= group + 4096  # once
    x = torch.randn(3, 16)
    assert same(step(plain, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)
