"""Relay's saved-tensor pair over PyTorch's corpora (op_db, module_db), where no hooks are below
it: what it passes on it keeps, detached where the tensor has a grad_fn (Note [passed on
detached] in relay/backward.py). Outputs and gradients must be bit for bit those of a run
without it, by tests/_support/corpus.py's rule.

The pair is relay's own, made by ``Saved`` for a relay with no slab swapped in, so every tensor
goes the way every tensor but a weight goes under relay: through the C pair, or through the
Python one where the library is not built. The default run takes each entry's first sample in
its first dtype, the two pairs dealt out to the entries in turn; the ``slow`` test runs every
sample of every dtype under both."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from offloadd.relay import backward
from tests._support import corpus

ENTRIES = corpus.entries()
PAIRS = ("c", "python")
_PUSH = torch._C._autograd._push_saved_tensors_default_hooks
_POP = torch._C._autograd._pop_saved_tensors_default_hooks


class _Passing:
    """Relay's pair with no hooks below it, in the shape the corpus harness runs an Offloader
    in (a context, ``synchronize``, ``stats``): it holds nothing once a graph is gone."""

    def __init__(self, pair: str) -> None:
        self.pair = pair
        self._nothing = types.SimpleNamespace(resident_bytes=0, disk_bytes=0, fallbacks=0)

    def __enter__(self) -> None:
        made = (backward.PassPack, backward.PassUnpack)
        if self.pair == "python":
            backward.PassPack = backward.PassUnpack = None
        try:
            saved = backward.Saved(types.SimpleNamespace(slab_group={}))  # type: ignore[arg-type]
            pack, unpack = saved._make_hooks(None, None)
        finally:
            backward.PassPack, backward.PassUnpack = made
        assert (type(pack) is backward.PassPack) == (self.pair == "c")
        _PUSH(pack, unpack)

    def __exit__(self, *exc: object) -> None:
        _POP()

    def synchronize(self) -> None:
        pass

    def stats(self) -> Any:
        return self._nothing


class _Pool:
    def get(self, config: Any) -> Any:
        return _Passing(config)

    def discard(self, config: Any) -> None:
        pass


def _check(entry: corpus.Entry, pair: str, dtype: torch.dtype, limit: int | None) -> list[str]:
    """The failures of ``entry``'s samples (the first ``limit``) in ``dtype`` under ``pair``."""
    failed = []
    for index, sample in enumerate(entry.samples(dtype, limit)):
        outcome = corpus.check(sample, _Pool(), [pair])[pair]  # type: ignore[arg-type, list-item]
        if outcome.status == "failed":
            failed.append(f"{corpus.dtype_name(dtype)} sample {index}: {outcome.reason}")
    return failed


def _cases() -> Iterator[Any]:
    for i, entry in enumerate(ENTRIES):
        yield pytest.param(entry, PAIRS[i % 2], id=f"{entry.name}-{PAIRS[i % 2]}")


@pytest.mark.parametrize(("entry", "pair"), list(_cases()))
def test_relay_pass_corpus_sample(entry: corpus.Entry, pair: str) -> None:
    dtypes = entry.dtypes()
    if not dtypes:
        pytest.skip(corpus.no_dtype_reason())
    failed = _check(entry, pair, dtypes[0], 1)
    assert not failed, f"{entry.name} under relay's {pair} pair: " + "; ".join(failed)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_relay_pass_corpus_full(entry: corpus.Entry) -> None:
    failed = [
        f"{pair} {f}"
        for pair in PAIRS
        for d in entry.dtypes()
        for f in _check(entry, pair, d, None)
    ]
    assert not failed, f"{entry.name}: {len(failed)} failing cases:\n" + "\n".join(failed)
