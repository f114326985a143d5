"""Which saved tensors a lossy codec may touch: the op that saves them, and which of them.

Note: [what gets compressed] Saved-tensor hooks do not say which op saves a tensor. While a codec
is on, :class:`OpScope` (a torch function mode, entered with the offloading scope on each
thread) notes the torch function running at the outermost level (``linear``, ``softmax``,
``scaled_dot_product_attention``…); pack compresses a saved tensor only if

* that function is in the allow list below (or in ``codec.ops``, which replaces it),
* the tensor has the shape of one of the function's tensor arguments (or that shape with its
  leading dims folded into one: the view ``linear`` and ``matmul`` save of a 3-D or 4-D input),
  so what an op saves beside its inputs and outputs (layer norm's mean and rstd, attention's
  logsumexp, which every probability is divided by) stays exact,
* it is not an argument the op needs exactly (``_EXACT_ARGS``: attention's q and k, from which
  backward recomputes the attention weights). This matches the argument itself: where sdpa
  falls back to its math backend (a mask that requires grad, a 3-D mask), it saves a scaled
  copy of q, which has q's shape at a new address and is coded (an error of the same size as on
  the fused path: docs/benchmarks/codec_error_cpu-2core_2026-11-24.md),
* it does not have the shape of a mask the op takes (``_MASK_ARGS``: attention's ``attn_mask``),
  folded or not. A kernel may save what it derives from a mask, a new tensor of the mask's
  shape that backward needs exactly: sdpa turns a bool mask into a float one of 0 and -inf.
  Its values do not tell it apart: masks are often filled with a large finite value (HF's
  ``torch.finfo(dtype).min``, -10000 in older models), and a group's range spanning it rounds
  every other value away (a bias added to the mask, ALiBi's or relative positions': at int8 or
  int4 a bias of -7.75 beside -10000 decodes 7.75 off). So the shape decides, for the mask
  itself too (a v or an output that happens to have the mask's shape stays exact with it),
* it is floating (float32, bfloat16, float16), strided, dense, not a parameter, and at least
  ``codec.min_bytes`` (bool masks, indices, RNG state and integer tensors never qualify), and
* every value in it is finite (see [non-finite values] in coder.py: found from the ranges the
  encoder computes anyway, the tensor is then saved exactly).

Everything else is saved exactly, as with ``codec = "none"``. The list holds the ops whose
gradients use a saved activation as a factor, where a small relative error stays small. Left
out, with the reason: comparisons (``max``, ``amax``, ``clamp``, ``relu``, ``threshold``: the
gradient's mask is decided by the saved values, so a rounded value moves it; ``relu``'s exact
bit mask is what ``memsave`` is for), divisions by a saved value (``div``, ``log``, ``sqrt``,
``pow`` with a negative exponent, ``reciprocal``: a value rounded towards zero blows up), dropout
(its mask must stay exact), the loss (``log_softmax``, ``cross_entropy``: log-probabilities
near -30 would lose their digits), and anything unknown.

Compression happens inside pack. For the ops listed that is after their inputs were computed
and before their kernel runs, and none of them writes a saved input (the case [capture after the
op] in runtime/capture.py guards against), so the bytes encoded are the bytes backward would
have read. An in-place change after the save still raises PyTorch's error at unpack (the coded
handle checks the version counter).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from typing import Any, Final

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DEFAULT_OPS", "OpScope", "kept_exact", "saved_shapes", "unknown_ops"]

DEFAULT_OPS: Final[dict[str, str]] = {
    "linear": "saves its input; grad_weight = grad^T @ input (Mesa and ActNN compress it)",
    "matmul": "saves both operands; each gradient is the other operand times grad",
    "bmm": "as matmul",
    "mm": "as matmul",
    "addmm": "as matmul (HF GPT-2's Conv1D)",
    "baddbmm": "as matmul",
    "conv1d": "saves its input; grad_weight correlates grad with it",
    "conv2d": "as conv1d",
    "conv3d": "as conv1d",
    "gelu": "saves its input; the derivative is smooth in it",
    "silu": "as gelu",
    "tanh": "saves its output; grad * (1 - y^2)",
    "sigmoid": "saves its output; grad * y * (1 - y)",
    "softmax": "saves its output in [0, 1]; grad is y * (g - sum(g * y)) (Mesa compresses it)",
    "layer_norm": (
        "saves its input (mean and rstd stay exact: other shapes); not with fp8: backward "
        "subtracts the exact mean from the decoded input, and fp8 keeps only 3 or 2 mantissa "
        "bits of a value near a large common offset, while the integer codes are uniform across "
        "the group, so int8 errs far less (docs/benchmarks/codec_error_cpu-2core_2026-11-24.md)"
    ),
    "mul": "saves both operands; each gradient is grad times the other",
    "scaled_dot_product_attention": (
        "saves q, k, v, the mask and the output; only v and the output are coded, and only "
        "without dropout: backward recomputes the attention weights from q, k and the mask "
        "against the exact logsumexp, so a rounding of those would be exponentiated (q's "
        "gradient far off with q and k coded: "
        "docs/benchmarks/codec_error_cpu-2core_2026-11-24.md); nothing of the mask's shape is "
        "coded (a -inf turns its group into NaN; beside a large fill such as finfo.min or "
        "-10000, a bias added to the mask rounds away)"
    ),
}
"""The default allow list: torch function name -> why a rounded saved activation is safe."""

_tls = threading.local()


def saved_shapes() -> frozenset[torch.Size] | None:
    """The shapes a saved tensor may have to be compressed now, or None (nothing may be)."""
    return getattr(_tls, "shapes", None)


def kept_exact(t: torch.Tensor) -> bool:
    """Whether ``t`` is an argument the op running now needs exactly (see ``_EXACT_ARGS``)."""
    exact = getattr(_tls, "exact", None)
    return exact is not None and _identity(t) in exact


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def _tensor_shapes(args: Iterable[Any], kwargs: dict[str, Any]) -> frozenset[torch.Size]:
    shapes: set[torch.Size] = set()
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            _add_folded(shapes, a.shape)
        elif isinstance(a, list | tuple):
            for x in a:
                if isinstance(x, torch.Tensor):
                    _add_folded(shapes, x.shape)
    return frozenset(shapes)


def _add_folded(shapes: set[torch.Size], shape: torch.Size) -> None:
    """``shape`` and the shapes with its leading dims folded into one: ``linear`` and ``matmul``
    save a ``(batch, tokens, d)`` input as the ``(batch * tokens, d)`` view they multiply, and a
    4-D ``matmul`` its ``(batch * heads, tokens, d)`` views."""
    shapes.add(shape)
    for k in range(2, len(shape)):
        shapes.add(torch.Size((math.prod(shape[:k]), *shape[k:])))


def _dropout_free(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    return not p


_CONDITIONS: Final[dict[str, Callable[[tuple[Any, ...], dict[str, Any]], bool]]] = {
    "scaled_dot_product_attention": _dropout_free,
}
_EXACT_ARGS: Final[dict[str, tuple[tuple[int, str], ...]]] = {
    "scaled_dot_product_attention": ((0, "query"), (1, "key")),
}
"""Arguments (position, name) an allowed op must save exactly (the reason is in DEFAULT_OPS):
the saved tensor that is that very argument (same address, shape, strides) stays exact."""

_MASK_ARGS: Final[dict[str, tuple[tuple[int, str], ...]]] = {
    "scaled_dot_product_attention": ((3, "attn_mask"),),
}
"""Mask arguments (position, name) of an allowed op: no saved tensor of a mask's shape (or that
shape folded) is coded, whatever its address (see [what gets compressed])."""


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, key: str) -> Any:
    return args[pos] if pos < len(args) else kwargs.get(key)


def _exact_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[Any]:
    out = set()
    for pos, key in _EXACT_ARGS.get(name, ()):
        a = _argument(args, kwargs, pos, key)
        if isinstance(a, torch.Tensor):
            out.add(_identity(a))
    return frozenset(out)


def _mask_shapes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[torch.Size]:
    out: set[torch.Size] = set()
    for pos, key in _MASK_ARGS.get(name, ()):
        a = _argument(args, kwargs, pos, key)
        if isinstance(a, torch.Tensor):
            _add_folded(out, a.shape)
    return out


_NOT_WITH: Final[dict[str, tuple[str, ...]]] = {"layer_norm": ("fp8-e4m3", "fp8-e5m2")}
"""Ops left exact under these codecs (the reason is in DEFAULT_OPS)."""


def unknown_ops(names: Iterable[str]) -> list[str]:
    """The names that are no torch function, ``torch.nn.functional`` one or tensor method."""
    spaces = (torch, torch.nn.functional, torch.Tensor, torch.special, torch.linalg, torch.fft)
    return [n for n in names if not any(hasattr(space, n) for space in spaces)]


class OpScope(TorchFunctionMode):
    """Notes, per thread, the shapes that the outermost torch function running allows to be
    compressed (see [what gets compressed])."""

    def __init__(self, ops: Iterable[str], codec: str = "int8") -> None:
        super().__init__()
        self.ops = frozenset(n for n in ops if codec not in _NOT_WITH.get(n, ()))

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        shapes = exact = None
        if name in self.ops:
            condition = _CONDITIONS.get(name)
            if condition is None or condition(args, kwargs):
                shapes = _tensor_shapes(args, kwargs)
                if name in _MASK_ARGS:
                    shapes -= _mask_shapes(name, args, kwargs)
                exact = _exact_args(name, args, kwargs) if name in _EXACT_ARGS else None
        outer = getattr(_tls, "shapes", None), getattr(_tls, "exact", None)
        _tls.shapes, _tls.exact = shapes, exact
        try:
            return func(*args, **kwargs)
        finally:
            _tls.shapes, _tls.exact = outer
