"""What a relayed weight is between its uses: :class:`RelayedWeight`.

Note [placeholder]
~~~~~~~~~~~~~~~~~~
A relayed weight's bytes live in the store (ssd, or the cpu tier's pinned pool on a GPU); its
module holds a :class:`RelayedWeight` in their place. The placeholder is a parameter on the meta
device that says its real shape, dtype and device, so that code that looks at weights
(``named_parameters()``, counting parameters, ``model.device``, building an optimizer, clearing
gradients with ``p.grad = None``: a frozen weight has none) works unchanged, and every other use
raises :class:`RelayError` naming the weight: reading it, or changing it in place, outside its
module's forward never sees stale or missing values. ``detach()`` too, except while its module
saves it into a ``state_dict()``: C++ code that takes the detached meta tensor
(DistributedDataParallel's first broadcast of every parameter) would otherwise skip it silently.

Storage resized to zero, the mechanism sharded training uses to free a parameter, was rejected:
a CPU tensor whose storage has no bytes is read without a check, and reading it segfaults.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from offloadd.runtime.identity import HoldsNoBytes

__all__ = ["RelayError", "RelayedWeight"]


class RelayError(RuntimeError):
    """A relayed weight was used where its bytes are not (or the relay cannot go on)."""


_T: Any = torch.Tensor
# What the placeholder answers: its metadata, never its values.
_ALLOWED = {
    _T.shape.__get__,
    _T.dtype.__get__,
    _T.requires_grad.__get__,
    _T.is_leaf.__get__,
    _T.grad.__get__,
    _T.ndim.__get__,
    _T.layout.__get__,
    _T.is_sparse.__get__,
    _T.is_quantized.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.__hash__,
    torch.Tensor.__format__,
}


# What the placeholder answers from the weight's real device: code that skips meta tensors as
# uninitialised (deferred-init loaders, sharding wrappers) must meet RelayError, not skip it.
_WHERE = {
    _T.device.__get__: lambda d: d,
    _T.is_cuda.__get__: lambda d: d.type == "cuda",
    _T.is_cpu.__get__: lambda d: d.type == "cpu",
    _T.is_meta.__get__: lambda d: d.type == "meta",
}

_HINTS = {
    "requires_grad_": " (unfreeze a relayed weight between steps: its group is then made resident)",
    "grad": " (a relayed weight is frozen: it has no gradient, and takes none but None)",
    "detach": (
        " (DistributedDataParallel reads every weight as it wraps the model: wrap it within "
        "`with offloadd.resident(model):`, or relay the wrapped model)"
    ),
}


def _what(func: Any) -> str:
    """``func`` in words: a tensor attribute's ``getset_descriptor.__set__`` as ``setting
    Tensor.grad``."""
    qualname = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    verb = {"__get__": "reading", "__set__": "setting", "__delete__": "deleting"}
    kind, _, method = qualname.partition(".")
    attr = getattr(getattr(func, "__self__", None), "__name__", None)
    if kind == "getset_descriptor" and method in verb and attr:
        return f"{verb[method]} Tensor.{attr}"
    return qualname


def _swap_in(
    args: Any, kwargs: dict[str, Any], trims: list[Any], reals: list[torch.Tensor]
) -> tuple[Any, dict[str, Any]] | None:
    """``args`` and ``kwargs`` with each placeholder replaced by its weight read in on demand
    (Note [on demand] in relayer.py), or None where one cannot be; ``trims`` gets each relay's
    ``trim``, to call once the op has run, and ``reals`` each weight read in."""
    ok = True

    def real(x: Any) -> Any:
        nonlocal ok
        if isinstance(x, RelayedWeight):
            use, trim = x.relay_use, x.relay_trim
            w = use(x) if use is not None else None
            if w is None:
                ok = False
            else:
                reals.append(w)
                if trim is not None and trim not in trims:
                    trims.append(trim)
            return w
        if isinstance(x, list | tuple):
            return type(x)(real(y) for y in x)
        return x

    new_args = tuple(real(a) for a in args)
    new_kwargs = {k: real(v) for k, v in kwargs.items()}
    return (new_args, new_kwargs) if ok else None


def _unaliased(out: Any, reals: list[torch.Tensor]) -> Any:
    """``out`` with each weight read in that the op gave back as it is (``.float()`` of a
    float32 weight, ``.contiguous()``) replaced by a tensor over the same bytes: the weight is
    emptied when its group is swapped out, a tensor viewing its bytes keeps them (as a view
    does), so what the op returned stays what it was once the window moves on."""
    ids = {id(w) for w in reals}

    def fix(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and id(x) in ids:
            return x.detach()  # a frozen weight: nothing to differentiate
        if isinstance(x, list | tuple):
            return type(x)(fix(y) for y in x)
        return x

    return fix(out)


class RelayedWeight(nn.Parameter, HoldsNoBytes):
    """The stand-in for a relayed weight (see Note [placeholder])."""

    relay_name: str
    real_device: torch.device
    relay_use: Any = None  # the relay's ``use``: the real weight, read in on demand, or None
    relay_trim: Any = None  # the relay's ``trim``: its window kept, after the op that used it
    relay_unfreeze: Any = None  # the relay's ``unfreeze``: the real weight, its group resident
    relay_saving = False  # its module's _save_to_state_dict runs: detach() gives the placeholder

    @staticmethod
    def make(like: torch.Tensor, name: str) -> RelayedWeight:
        meta = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
        w: RelayedWeight = torch.Tensor._make_subclass(RelayedWeight, meta, False)
        w.relay_name = name
        w.real_device = like.device
        return w

    def __new__(cls, *args: Any, **kwargs: Any) -> RelayedWeight:
        raise TypeError("RelayedWeight is made by offloadd.relay(), not directly")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func in _WHERE:  # the real device, not the meta tensor's
                return _WHERE[func](args[0].real_device)
            if func in _ALLOWED:
                return func(*args, **kwargs)
            if func is torch.Tensor.detach and args[0].relay_saving:
                return args[0]  # within state_dict(): its hooks put the values in
            if func is torch.Tensor.requires_grad_ or func == _T.requires_grad.__set__:
                wanted = kwargs.get("requires_grad", args[1] if len(args) > 1 else True)
                if not wanted:
                    return args[0] if func is torch.Tensor.requires_grad_ else None
                unfreeze = args[0].relay_unfreeze
                real = unfreeze(args[0]) if unfreeze is not None else None
                if real is not None:  # its group made resident (Note [made resident] in release.py)
                    real.requires_grad_(True)
                    return real if func is torch.Tensor.requires_grad_ else None
            # clearing the gradient (``p.grad = None``, ``del p.grad``): metadata, no byte of
            # the weight; a frozen weight has none anyway
            if func == _T.grad.__delete__ or (func == _T.grad.__set__ and args[1] is None):
                return func(*args, **kwargs)
        trims: list[Any] = []
        reals: list[torch.Tensor] = []
        try:
            real = _swap_in(args, kwargs, trims, reals)
            out = _unaliased(func(*real[0], **real[1]), reals) if real is not None else None
        except BaseException:
            for trim in trims:  # the op's own error first, not a write found on swapping out
                with contextlib.suppress(RelayError):
                    trim()
            raise
        for trim in trims:
            trim()
        if real is not None:
            return out
        w = next(a for a in args if isinstance(a, RelayedWeight)) if args else None
        name = getattr(w, "relay_name", "?")
        what = _what(func)
        raise RelayError(
            f"the weight {name!r} is relayed by offloadd (its bytes are in the store outside "
            f"its module's forward), so {what} cannot use it here: use it inside the module's "
            "forward, or within `with offloadd.resident(model):`, or call offloadd.unrelay(model)"
            + _HINTS.get(what.rsplit(".", 1)[-1], "")
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        with torch._C.DisableTorchFunctionSubclass():
            shape = tuple(self.shape)
            dtype = self.dtype
        return f"RelayedWeight({self.relay_name!r}, shape={shape}, dtype={dtype}, device={self.real_device})"

    def __reduce_ex__(self, proto: Any) -> Any:
        raise RelayError(
            f"the weight {self.relay_name!r} is relayed by offloadd: save the model's "
            "state_dict() (relay reads the values in), or unrelay it first"
        )

    def __deepcopy__(self, memo: Any) -> Any:
        raise RelayError(
            f"the weight {self.relay_name!r} is relayed by offloadd: copy the model after "
            "offloadd.unrelay(model), or copy its state_dict()"
        )
