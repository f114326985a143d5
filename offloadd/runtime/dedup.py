"""Which storage a saved tensor lives in: a parameter's (never moved), or one already saved.

Note: [dedup identity] Views, transposes and expands of one storage are saved as separate
tensors; a storage is moved once and each saved tensor becomes a ref to its block. The key is
(device, StorageImpl address, version, dtype). The weak reference kept with each entry pins the
StorageImpl's address while the entry lives, so an equal address means the same storage, never
a new one at a reused address. The root (``t._base`` or ``t``) must be the same object too: that
keeps apart aliases that do not share a version counter (``.data``, ``set_``), one of which may
have been changed in place since the first save. The dtype is in the key because a pending
block's refs are views of its source.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offloadd.runtime.blocks import Block
from offloadd.runtime.handles import storage_of

__all__ = ["StorageIndex", "is_parameter"]

_Parameter = torch.nn.Parameter
_Tensor = torch.Tensor
_NoTorchFunction = torch._C.DisableTorchFunction


def is_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or a view of one (no storage lookup: pack's lock-free path
    asks too). A leaf that requires grad is not a parameter by itself: the detached inputs of
    reentrant checkpointing are such leaves, and they are activations."""
    tp = type(t)
    if tp is _Parameter:
        return True
    if tp is _Tensor and not t.__dict__:
        # A plain tensor without attributes cannot pass Parameter's isinstance (which looks for
        # ``_is_param``, raising inside getattr: 1 µs per saved tensor); its base still may.
        base = t._base
        return base is not None and (type(base) is _Parameter or isinstance(base, _Parameter))
    return isinstance(t, _Parameter) or isinstance(t._base, _Parameter)


class StorageIndex:
    """Parameter storages seen in the scope, and storages already saved (lock held)."""

    def __init__(self, dedup: bool) -> None:
        self.dedup = dedup
        self._saved: dict[tuple[Any, ...], tuple[StorageWeakRef, Any, Block]] = {}
        self._params: dict[tuple[Any, ...], StorageWeakRef] = {}

    # -- parameters ------------------------------------------------------------------------

    def note_module(self, module: torch.nn.Module) -> None:
        """Remember the storages that back ``module``'s own parameters and buffers.

        Lazy modules' uninitialized parameters and buffers, meta tensors and tensors without a
        storage of their own (functorch wrappers) are skipped, never touched. Their attributes
        are read with torch functions off: this runs in a module's pre-hook, inside the scope,
        where a torch function mode may be on (the codec's ``OpScope``, a user's), and each read
        would be a call of its ``__torch_function__`` in Python, per parameter and module call,
        whose tuples and attribute names, made afresh, the interpreter's free lists and type
        cache keep for thousands of steps."""
        with _NoTorchFunction():
            for tensors in (module._parameters, module._buffers):
                for p in tensors.values():
                    s = storage_of(p) if p is not None else None
                    if p is not None and s is not None:
                        self._params[(p.device, s._cdata)] = StorageWeakRef(s)

    def clear_parameters(self) -> None:
        self._params.clear()

    def backs_parameter(self, t: torch.Tensor, storage: torch.UntypedStorage) -> bool:
        """Whether ``t`` is a parameter, a view of one, or shares the storage of a parameter or
        buffer of a module called in the scope (a transposed weight, an FSDP flat parameter)."""
        if is_parameter(t):
            return True
        ref = self._params.get((t.device, storage._cdata))
        return ref is not None and not ref.expired()

    # -- saved storages (see [dedup identity]) ---------------------------------------------

    @staticmethod
    def key(t: torch.Tensor, storage: torch.UntypedStorage) -> tuple[Any, ...]:
        return (t.device, storage._cdata, t._version, t.dtype)

    def lookup(self, key: tuple[Any, ...], root: torch.Tensor) -> Block | None:
        """The live block already holding this storage, if dedup is on and there is one."""
        if not self.dedup:
            return None
        hit = self._saved.get(key)
        if hit is not None and not hit[0].expired() and hit[1]() is root and not hit[2].freed:
            return hit[2]
        return None

    def remember(
        self, key: tuple[Any, ...], storage: torch.UntypedStorage, root: torch.Tensor, block: Block
    ) -> None:
        if self.dedup:
            block.key = key
            self._saved[key] = (StorageWeakRef(storage), weakref.ref(root), block)

    def forget(self, block: Block) -> None:
        if block.key is not None:
            hit = self._saved.get(block.key)
            if hit is not None and hit[2] is block:
                del self._saved[block.key]
