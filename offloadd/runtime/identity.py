"""What a saved tensor is: a parameter's or not, its storage and bytes, its version counter.

The one module of the runtime meant to be shared: the runtime's pack path and its plug-ins (the
codec, relay) ask these questions of a tensor here, and nowhere else. Each answer reads only the
tensor (no lock, no state of an Offloader), so pack's lock-free path may ask too.
"""

from __future__ import annotations

import torch
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "Facts",
    "HoldsNoBytes",
    "describe",
    "inplace_error",
    "is_parameter",
    "nbytes_of",
    "storage_bytes",
    "storage_of",
    "unlinked",
    "version_handle",
]

_Parameter = torch.nn.Parameter
_Tensor = torch.Tensor


def is_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or a view of one (no storage lookup: pack's lock-free path
    asks too). A leaf that requires grad is not a parameter by itself: the detached inputs of
    reentrant checkpointing are such leaves, and they are activations."""
    tp = type(t)
    if tp is _Parameter:
        return True
    return _of_parameter(t, tp, t._base)


def _of_parameter(t: torch.Tensor, tp: type, base: torch.Tensor | None) -> bool:
    """:func:`is_parameter` for a tensor that is not a ``Parameter`` itself, its ``_base`` read."""
    if tp is _Tensor and not t.__dict__:
        # A plain tensor without attributes cannot pass Parameter's isinstance (which looks for
        # ``_is_param``, raising inside getattr: a cost per saved tensor, see
        # docs/benchmarks/hooks_cpu-2core_2026-12-05.md); its base still may.
        return base is not None and (type(base) is _Parameter or isinstance(base, _Parameter))
    return isinstance(t, _Parameter) or isinstance(base, _Parameter)


_HINT_ANOMALY = (
    "Hint: the backtrace further above shows the operation that failed to compute its gradient. "
    "The variable in question was changed in there or anywhere later. Good luck!"
)
_HINT = (
    "Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
    "with torch.autograd.set_detect_anomaly(True, check_nan=False)."
)


def inplace_error(t_desc: str, saved: int, now: int) -> RuntimeError:
    """PyTorch's own error for a saved tensor changed in place, with the hint it gives with and
    without anomaly detection. PyTorch also names the node the tensor is an output of (``,
    which is output 0 of Exp,``): that would cost reading ``grad_fn`` at every pack (see [no
    cycle through the graph]), and is left out."""
    hint = _HINT_ANOMALY if torch.is_anomaly_enabled() else _HINT
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{t_desc}] is at version {now}; expected version {saved} instead. {hint}"
    )


def describe(t: torch.Tensor) -> str:
    return f"{t.type()} {list(t.shape)}"


def unlinked(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its link into the graph, to be held by a packed object.

    Note: [no cycle through the graph] An op that saves its own output (exp, sigmoid, softmax)
    hands pack that output, whose ``grad_fn`` is the very node that will own the packed object.
    Holding it would make a cycle node -> packed object -> tensor -> node through autograd's
    C++ graph, which no garbage collector can see: a graph dropped without backward would never
    be freed. A detached alias shares the storage and the version counter, which is all that
    offloadd needs; autograd restores the graph links itself at unpack. (Decided on
    ``requires_grad``: reading ``grad_fn`` of a stale view creates a node, which would move the
    node number that capture.py relies on.)"""
    return t.detach() if t.requires_grad else t


_BELOW_INPLACE_OR_VIEW = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)


def version_handle(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor without storage that shares ``t``'s version counter (None if this torch cannot
    make one without bumping the counter). See [the version handle] in capture.py."""
    if _BELOW_INPLACE_OR_VIEW is None:
        return None
    h = t.detach()
    with _BELOW_INPLACE_OR_VIEW():  # below the kernel that bumps versions: set_ leaves it alone
        h.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())
    return h


class HoldsNoBytes:
    """A mixin for tensor subclasses whose bytes are elsewhere and must not be asked for
    (``offloadd.relay``'s placeholder): :func:`storage_of` gives None for them, untouched."""


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of a materialized, strided, non-meta tensor, else None (never raises)."""
    if isinstance(t, HoldsNoBytes) or is_lazy(t) or t.layout is not torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except Exception:  # no storage of its own (functorch wrappers, some subclasses)
        return None


class Facts:
    """What offloadd asks of a saved tensor that may move or be encoded, asked once.

    Note [asked once]
    ~~~~~~~~~~~~~~~~~
    A tensor on pack's slow path (one large enough to move, one the codec may encode) meets
    several parts in turn: the codec's tables, the parameter index, dedup's, the block that
    moves it. Each needs its storage, whether it is a parameter's, and its root (``t._base``
    or ``t``, the object whose version counter its views share). Pack asks those once, here,
    and hands the answers on; no part asks the tensor again. (The C path, for small tensors
    and tier keep, asks each once on its own: held.c.)"""

    __slots__ = ("parameter", "root", "storage")

    def __init__(self, t: torch.Tensor) -> None:
        self.storage = storage_of(t)  # None: no bytes of its own to move or count
        base = t._base
        tp = type(t)
        self.parameter = tp is _Parameter or _of_parameter(t, tp, base)
        self.root = t if base is None else base

    def movable(self, t: torch.Tensor, host_to_host: bool) -> torch.UntypedStorage | None:
        """The storage, if ``t`` is a plain dense CPU/CUDA tensor that can be moved and rebuilt.

        ``host_to_host``: moving it would copy host memory to host memory (the cpu tier, a
        tensor already in host memory), which saves nothing."""
        if (
            t.device.type not in ("cpu", "cuda")
            or host_to_host
            or t.is_quantized
            or t.is_conj()
            or t.is_neg()
        ):
            return None
        return self.storage


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of a tensor offloadd does not move, for the stats; 0 where it has no such size.

    A wrapper subclass counts the tensors it wraps, which are what this process holds: a
    DTensor its local shard (its own ``nbytes`` is the global size, world-size times the shard
    of a sharded one), a TwoTensor both halves."""
    if is_traceable_wrapper_subclass(t):
        try:
            names, _ = t.__tensor_flatten__()
            inner = [getattr(t, name) for name in names]
        except Exception:  # a subclass whose flatten needs more than a plain call
            inner = None
        if inner is not None:
            return sum(nbytes_of(x) for x in inner if isinstance(x, torch.Tensor))
    if t.layout is not torch.strided:
        return 0
    try:
        return int(t.nbytes)
    except Exception:  # symbolic or data-dependent sizes (tracing)
        return 0


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of ``t``'s storage, as a flat uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
