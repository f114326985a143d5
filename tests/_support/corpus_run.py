"""One run of a corpus sample, and the bit-exact comparison of two runs.

What a run is and how two runs compare (fresh inputs, RNG, gradients, equality) is the rule in
the docstring of tests/_support/corpus.py; this module implements it. Used by tests/_support/corpus.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from offloadd import Offloader

SEED = 0

# -- results and their comparison -------------------------------------------------------------

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _plain(t: torch.Tensor) -> torch.Tensor:
    """Dense, conjugation and negation resolved, complex as (real, imag) pairs."""
    if t.layout is not torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg()
    return torch.view_as_real(t) if t.is_complex() else t


def difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if ``a`` and ``b`` are bit-identical (a NaN equals any NaN), else what differs."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    a, b = _plain(a), _plain(b)
    if a.is_floating_point():
        bits = _INT_OF_SIZE[a.element_size()]
        same = (a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())
    else:
        same = a == b
    if bool(same.all()):
        return None
    first = tuple(int(i) for i in (~same).nonzero()[0])
    values = f"{a[first].item()!r} vs {b[first].item()!r}"
    return (
        f"{int((~same).sum())} of {same.numel()} elements differ, first at {list(first)}: {values}"
    )


@dataclass
class Result:
    """What one run produced: its tensor outputs and the gradient for each name in ``wrt``."""

    outputs: list[torch.Tensor]
    wrt: list[str]
    grads: list[torch.Tensor | None] | None  # None: no output requires grad


def _kind(grad: torch.Tensor | None) -> str:
    return "None" if grad is None else "a tensor"


def result_difference(ref: Result, got: Result) -> str | None:
    """The first difference between two runs of the same sample, or None."""
    if len(ref.outputs) != len(got.outputs):
        return f"{len(ref.outputs)} outputs vs {len(got.outputs)}"
    for i, (a, b) in enumerate(zip(ref.outputs, got.outputs, strict=True)):
        if (d := difference(a, b)) is not None:
            return f"output {i}: {d}"
    if (ref.grads is None) != (got.grads is None) or ref.wrt != got.wrt:
        return "different outputs require grad"
    for name, a, b in zip(ref.wrt, ref.grads or [], got.grads or [], strict=True):
        if (a is None) != (b is None):
            return f"grad of {name}: {_kind(a)} vs {_kind(b)}"
        if a is not None and b is not None and (d := difference(a, b)) is not None:
            return f"grad of {name}: {d}"
    return None


# -- running one sample -----------------------------------------------------------------------


def _copy_layout(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in a new storage with the same size, stride, offset (and overlap)."""
    if x.layout is not torch.strided or x.is_conj() or x.is_neg():
        return x.clone()
    storage = x.untyped_storage().clone()
    return x.new_empty(0).set_(storage, x.storage_offset(), x.size(), x.stride())


class _Fresh(torch.autograd.Function):
    """Identity whose output is a non-leaf copy of its input (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _copy_layout(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _fresh(x: torch.Tensor) -> torch.Tensor:
    if x.requires_grad:
        return _Fresh.apply(x)  # type: ignore[no-any-return]
    return _copy_layout(x)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor in it (through lists, tuples and dicts) replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple (PackedSequence)
        return type(obj)(*(map_tensors(o, fn) for o in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (tensor outputs of structseqs and namedtuples included)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def fresh_inputs(*objs: Any) -> tuple[list[Any], list[tuple[str, torch.Tensor]]]:
    """Fresh copies of ``objs`` (one copy per distinct tensor) and the leaves to differentiate."""
    memo: dict[int, torch.Tensor] = {}
    leaves: list[tuple[str, torch.Tensor]] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = _fresh(t)
            if t.requires_grad:
                leaves.append((f"input {len(leaves)}", t))
        return memo[id(t)]

    return [map_tensors(o, copy) for o in objs], leaves


def _weight(t: torch.Tensor, index: int) -> torch.Tensor:
    """The fixed grad_output of output ``index`` (from a generator of its own: the global RNG is
    left alone)."""
    gen = torch.Generator().manual_seed(SEED + 1000 + index)
    return torch.randn(t.shape, generator=gen, dtype=t.dtype)


def backward(out: Any, wrt: list[tuple[str, torch.Tensor]], off: Offloader | None) -> Result:
    outputs = tensors_in(out)
    diff = [t for t in outputs if t.requires_grad]
    result = Result([t.detach() for t in outputs], [name for name, _ in wrt], None)
    if diff and wrt:
        if off is not None:
            off.synchronize()
        weights = [_weight(t, i) for i, t in enumerate(diff)]
        grads = torch.autograd.grad(diff, [t for _, t in wrt], weights, allow_unused=True)
        result.grads = list(grads)
    return result


def seed_rng() -> None:
    # The CPU generator is all that these CPU runs use. torch.manual_seed also queues a seed for
    # lazily initialised CUDA with a formatted stack, which costs milliseconds a call.
    torch.default_generator.manual_seed(SEED)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels where PyTorch has them (a warning where not), and new tensors filled
    instead of left uninitialised, so that an op reading memory it never wrote (``linalg.lstsq``)
    gives the same result in both runs. Restores the previous setting."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def scope(off: Offloader | None) -> contextlib.AbstractContextManager[Any]:
    return off if off is not None else contextlib.nullcontext()
