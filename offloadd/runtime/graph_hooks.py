"""Offload and reload as ops inside a compiled graph, so that a model compiled whole streams.

Note [offload ops in the graph]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A compiled region is one autograd node (see [regions under compile] in compiled.py): left to
saved-tensor hooks, all its saved tensors reach pack when its forward returns and unpack before
its backward's first op. AOTAutograd has a way in: saved-tensor hooks that are ``fx.GraphModule``s
are *inlined*: traced into the forward graph's epilogue (pack) and the backward graph's prologue
(unpack), for the intermediates the region saves (``saved_tensors_hooks_filtering_mode``
"donated": never an input or a parameter), and dynamo guards the region on the hooks' ids. So
with ``Config.compile_ops``, for each call of a compiled model (``torch.compile``'s wrapper) in
an Offloader's scope, offloadd pushes two such hooks, popped by a global forward hook that runs
when that call returns or raises (so hooks the user opens around the call, checkpoint's, and
eager ops after it are untouched; eager code inside the call, at a graph break, gets the
Offloader's own pack and unpack through them, and a ``BaseException``, which skips forward
hooks, is unwound at the scope's exit):

* pack is the op ``offloadd::stash(t)``: ``Offloader._pack`` on a copy of ``t``, the block
  captured at once (the op that made ``t`` has returned: it ran before this op), and a token
  (one int64) returned in ``t``'s place. A copy, because inductor reuses a buffer's memory for
  later buffers once its last reader ran, and its kernels write without bumping versions: bytes
  still to be written from ``t`` itself could be overwritten;
* unpack is ``offloadd::fetch(token, size, stride, dtype)``: ``Offloader._unpack`` of the token's
  handle, copied into a fresh tensor of exactly ``t``'s strides (inductor asserts them, and may
  again reuse what the op returns).

Then a post-grad pass of inductor (:class:`Placement`, chained before any pass the user set)
moves each ``stash`` to just after its tensor's last use in forward, and each ``fetch`` to just
before its first use in backward. A block's activations are thus written while the next block
computes and read back, with the prefetch running ahead, while the later ones are used: the
region streams as eager does, and the kernels are the graph's own (bit-identical to the same
model compiled without offloadd: the tokens add two small ops per saved tensor).

Why opt-in: inductor schedules a buffer read by an op differently from one returned by the
graph, and sometimes fuses the loops around it differently. On an 8-block MLP the gradients
were bit-identical; on ``(h.t().contiguous().t() * h[:, ::2].sin().repeat(1, 2)).cos().sum()``
the sum's loop was fused with the sin's and no longer vectorised, and the loss moved by one
ulp. Bit-identity to training without offloadd is the default; this is the choice to stream a
model compiled whole at that price. If another pass holds inductor's one post-grad setting, the
ops stay at the graph's ends (exact placement is then impossible; offloadd warns once).

The token's lifetime is the saved tensor's: its bytes are a ``_Holder`` that keeps the handle,
so when autograd frees the node (after backward, or a graph never backwarded) the holder goes,
and with it the block; ``retain_graph`` keeps it for the next backward. With ``aot_eager`` (no
post-grad passes) the ops stay at the ends: exact, but nothing streams, as before.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from typing import Any

import torch
import torch.fx
from torch import Tensor

from offloadd.runtime.compiled import is_traced, unseen

__all__ = ["NO_PLACEMENT", "Placement", "enter", "live_tokens", "unwind"]

_lock = threading.Lock()
_tokens: dict[int, weakref.ref[_Holder]] = {}
_keys = itertools.count(1)
_current = threading.local()  # the Offloader whose scope pushed the hooks, on this thread


class _Holder(bytearray):
    """A token's bytes (its key), holding the handle pack returned while any tensor views them."""

    __slots__ = ("__weakref__", "handle", "off")
    handle: Any
    off: Any


def _forget(key: int, _ref: object) -> None:
    with _lock:
        _tokens.pop(key, None)


def live_tokens() -> int:
    """Tokens whose saved tensor is still held (for tests: 0 once every graph is freed)."""
    with _lock:
        return len(_tokens)


@torch.library.custom_op("offloadd::stash", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def stash(t: Tensor) -> Tensor:
    off = _current.off
    handle = off._pack(t.clone())
    off._life.capture_all()  # t's producer has returned: this op runs after it
    key = next(_keys)  # atomic under the GIL
    holder = _Holder(key.to_bytes(8, "little"))
    holder.handle = handle
    holder.off = off
    with _lock:
        _tokens[key] = weakref.ref(holder, functools.partial(_forget, key))
    return torch.frombuffer(holder, dtype=torch.int64)


@stash.register_fake
def _stash_fake(t: Tensor) -> Tensor:
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("offloadd::fetch", mutates_args=())
def fetch(
    token: Tensor, size: list[int], stride: list[int], dtype: torch.dtype, device: torch.device
) -> Tensor:
    with _lock:
        holder = _tokens[int(token[0])]()
    assert holder is not None  # the token's tensor holds it
    saved = holder.off._unpack(holder.handle)
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    return out.copy_(saved)


@fetch.register_fake
def _fetch_fake(
    token: Tensor, size: list[int], stride: list[int], dtype: torch.dtype, device: torch.device
) -> Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


_EAGER = object()  # marks what pack returned when autograd itself called the hook


@torch.fx.wrap
@unseen  # called by autograd itself at a graph break: never traced by dynamo
def _pack(t: Tensor) -> Any:
    if not is_traced(t):
        # Autograd calls the hook itself: eager code inside the compiled call (a graph break, a
        # disabled submodule). Offloader's own pack, as in eager (parameters kept, versions
        # checked); the ops are for what AOTAutograd traces.
        off = _current.off
        return (_EAGER, off, off._pack(t))
    return (torch.ops.offloadd.stash(t), list(t.size()), list(t.stride()), t.dtype, t.device)


@torch.fx.wrap
@unseen
def _unpack(packed: Any) -> Tensor:
    if packed[0] is _EAGER:
        unpacked: Tensor = packed[1]._unpack(packed[2])
        return unpacked
    return torch.ops.offloadd.fetch(*packed)


def _pack_hook(t: Tensor) -> Any:
    return _pack(t)


def _unpack_hook(packed: Any) -> Tensor:
    return _unpack(packed)


_HOOKS: list[torch.fx.GraphModule] = []
_calls = threading.local()  # per call on this thread: (module, hooks, Offloader before, its own)
_post_hook: list[Any] = []

NO_PLACEMENT = (
    "offloadd: compile_ops: torch._inductor.config.post_grad_custom_post_pass is set by someone "
    "else, so offloadd's ops stay at the ends of compiled graphs (exact, but nothing streams "
    "while the model computes); see [offload ops in the graph]"
)


def enter(off: Any, module: torch.nn.Module) -> bool:
    """Push the inlinable hooks for this call of ``module`` (``torch.compile``'s wrapper) by
    ``off``, popped when the call returns or raises (the same hook objects every time: dynamo
    guards a region on their ids). False if the placement pass could not be installed."""
    if not _HOOKS:
        _HOOKS.extend((torch.fx.symbolic_trace(_pack_hook), torch.fx.symbolic_trace(_unpack_hook)))
        _post_hook.append(
            torch.nn.modules.module.register_module_forward_hook(_call_ended, always_call=True)
        )
    placed = _install_placement()
    hooks = torch.autograd.graph.saved_tensors_hooks(_HOOKS[0], _HOOKS[1])
    hooks.__enter__()
    stack = _calls.__dict__.setdefault("stack", [])
    stack.append((module, hooks, getattr(_current, "off", None), off))
    _current.off = off
    return placed


def _call_ended(module: torch.nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return  # traced by dynamo (an inner module): nothing to do
    stack = getattr(_calls, "stack", None)
    while stack and stack[-1][0] is module:  # one entry per Offloader in scope
        _pop(stack)


def unwind(off: Any) -> None:
    """At ``off``'s scope exit: pop what a call inside it left (a ``BaseException`` skips the
    forward hooks: a KeyboardInterrupt in the compiled call)."""
    stack = getattr(_calls, "stack", None)
    while stack and any(entry[3] is off for entry in stack):
        _pop(stack)


def _pop(stack: list[Any]) -> None:
    _, hooks, before, _off = stack.pop()
    hooks.__exit__(None, None, None)
    _current.off = before


# -- placement -------------------------------------------------------------------------------

from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402


class Placement(CustomGraphPass):
    """Inductor's post-grad pass: each ``stash`` just after its tensor's last use in forward,
    each ``fetch`` just before its first use in backward (Note [offload ops in the graph])."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        stash_op = torch.ops.offloadd.stash.default
        fetch_op = torch.ops.offloadd.fetch.default
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            if node.target is stash_op:
                src = node.args[0]
                readers = [u for u in src.users if u is not node and u.op != "output"]
                last = max([src, *readers], key=order.__getitem__)
                if order[last] + 1 < order[node]:
                    last.append(node)
            elif node.target is fetch_op and node.users:
                first = min(node.users, key=order.__getitem__)
                first.prepend(node)

    def uuid(self) -> Any:
        return "offloadd-placement-1"


def _install_placement() -> bool:
    """Placement as inductor's post-grad pass, unless another pass holds that one setting."""
    from torch._inductor import config

    prior = config.post_grad_custom_post_pass
    if prior is None:
        config.post_grad_custom_post_pass = Placement()
    return isinstance(config.post_grad_custom_post_pass, Placement)
