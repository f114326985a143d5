"""The storage index on its own (offloadd/runtime/dedup.py): parameter storages learned from the
models it is told of (Note [parameters learned]), and storages already saved (Note [dedup
identity])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offloadd.runtime import dedup
from offloadd.runtime.blocks import Block
from offloadd.runtime.dedup import StorageIndex
from offloadd.runtime.identity import Facts

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def _backs(index: StorageIndex, t: torch.Tensor) -> bool:
    return index.backs_parameter(t, Facts(t))


def test_parameters_and_their_views_back_parameters_without_a_model() -> None:
    index = StorageIndex(dedup=True)
    w = nn.Parameter(torch.randn(4, 4))
    assert _backs(index, w) and _backs(index, w[1:]) and _backs(index, w.t())


def test_an_activation_that_requires_grad_is_never_a_parameter() -> None:
    index = StorageIndex(dedup=True)
    model = _model()
    index.note_module(model)
    x = torch.randn(2, 4, requires_grad=True)
    assert not _backs(index, x) and not _backs(index, model[0](x))


def test_buffers_and_aliases_of_a_noted_model_are_found_by_storage() -> None:
    index = StorageIndex(dedup=True)
    model = _model()
    index.note_module(model)
    bn = model[1]
    assert bn.running_mean is not None
    assert _backs(index, bn.running_mean)  # a buffer
    assert _backs(index, model[0].weight.data)  # a plain alias: no grad, same storage
    assert _backs(index, model[0].weight.detach().t())  # and a view of that
    assert not _backs(index, torch.randn(4))  # no model's storage


def test_a_model_moved_after_note_module_is_learned_again(walks: list[int]) -> None:
    index = StorageIndex(dedup=True)
    model = _model()
    index.note_module(model)
    index.step = 1
    model.double()  # new storages for every parameter and buffer
    assert _backs(index, model[1].running_var)
    assert walks == [1]
    index.step = 2
    assert not _backs(index, torch.randn(3))  # nothing moved: no walk
    assert walks == [1]


def test_an_unknown_tensor_walks_at_most_once_a_step(walks: list[int]) -> None:
    index = StorageIndex(dedup=True)
    index.note_module(_model())
    index.step = 1
    for _ in range(3):
        assert not _backs(index, torch.randn(3))
    assert walks in ([], [1])  # the marks are where they were: maybe no walk at all
    index.step = 1 + dedup.RELEARN_EVERY
    assert not _backs(index, torch.randn(3))
    assert walks[-1] == 1 + dedup.RELEARN_EVERY  # stale marks: walked once more


def test_a_collected_model_leaves_nothing_known() -> None:
    index = StorageIndex(dedup=True)
    model = _model()
    index.note_module(model)
    alias = model[0].weight.data
    del model
    index.step = 1
    assert _backs(index, alias)  # the alias keeps the storage alive: still the model's
    del alias
    index.step = 2
    assert not _backs(index, torch.randn(4))


def test_lookup_finds_what_was_remembered_for_the_same_root() -> None:
    index = StorageIndex(dedup=True)
    t = torch.randn(8)
    s = t.untyped_storage()
    key = index.key(t, Facts(t))
    assert key == (CPU, s._cdata, t._version, torch.float32)
    assert index.lookup(key, t) is None
    block = Block(1, s.nbytes(), CPU, 4096)
    index.remember(key, s, t, block)
    assert block.key == key
    assert index.lookup(key, t) is block
    assert index.lookup(key, torch.randn(8)) is None  # another root: an alias of its own
    assert (
        index.lookup(index.key(t.view(torch.int32), Facts(t.view(torch.int32))), t) is None
    )  # another dtype


def test_a_change_in_place_makes_a_new_key() -> None:
    index = StorageIndex(dedup=True)
    t = torch.randn(8)
    s = t.untyped_storage()
    index.remember(index.key(t, Facts(t)), s, t, Block(1, s.nbytes(), CPU, 4096))
    t.add_(1)
    assert index.lookup(index.key(t, Facts(t)), t) is None


def test_a_freed_block_is_not_joined() -> None:
    index = StorageIndex(dedup=True)
    t = torch.randn(8)
    s = t.untyped_storage()
    key = index.key(t, Facts(t))
    block = Block(1, s.nbytes(), CPU, 4096)
    index.remember(key, s, t, block)
    block.freed = True
    assert index.lookup(key, t) is None


def test_forget_removes_only_its_own_entry() -> None:
    index = StorageIndex(dedup=True)
    t = torch.randn(8)
    s = t.untyped_storage()
    key = index.key(t, Facts(t))
    old, new = Block(1, 32, CPU, 4096), Block(2, 32, CPU, 4096)
    index.remember(key, s, t, old)
    index.remember(key, s, t, new)  # the same key, saved again: the newer block wins
    index.forget(old)
    assert index.lookup(key, t) is new
    index.forget(new)
    assert index.lookup(key, t) is None
    index.forget(Block(3, 32, CPU, 4096))  # never remembered: nothing


def test_without_dedup_nothing_is_remembered() -> None:
    index = StorageIndex(dedup=False)
    t = torch.randn(8)
    s = t.untyped_storage()
    key = index.key(t, Facts(t))
    block = Block(1, s.nbytes(), CPU, 4096)
    index.remember(key, s, t, block)
    assert block.key is None and index.lookup(key, t) is None


def test_outermost_module_is_the_outermost_call_on_the_stack() -> None:
    seen: list[nn.Module | None] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(dedup.outermost_module())
            return x

    outer = nn.Sequential(nn.Sequential(Probe()))
    outer(torch.zeros(1))
    assert seen == [outer]
    assert dedup.outermost_module() is None
