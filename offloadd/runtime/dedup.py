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

import sys
import types
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offloadd.runtime.blocks import Block
from offloadd.runtime.identity import Facts, storage_of

__all__ = ["StorageIndex", "outermost_module", "outermost_self"]

_Parameter = torch.nn.Parameter
_Tensor = torch.Tensor
_NoTorchFunction = torch._C.DisableTorchFunction


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def outermost_self(code: types.CodeType) -> Any:
    """``self`` of the outermost frame of ``code`` on this thread's Python stack, if any."""
    found = None
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            found = frame
        frame = frame.f_back
    return None if found is None else found.f_locals.get("self")


def outermost_module() -> torch.nn.Module | None:
    """The module whose call is outermost on this thread's Python stack, if any."""
    module = outermost_self(_CALL_IMPL)
    return module if isinstance(module, torch.nn.Module) else None


def _module_storage(p: torch.Tensor) -> torch.UntypedStorage | None:
    """:func:`storage_of` a parameter or buffer; a plain one the cheap way (no subclass)."""
    if (type(p) is _Parameter or type(p) is _Tensor) and not p.is_meta:
        try:
            return p.untyped_storage()
        except Exception:  # sparse
            return None
    return storage_of(p)


RELEARN_EVERY = 64


class StorageIndex:
    """Parameter storages of the modules in the scope, and storages already saved (lock held).

    Note: [parameters learned] A parameter, or a view of one, is told by its type (``is_parameter``).
    Other tensors that share a module's storage (a buffer, a view of one, ``weight.data``, an
    FSDP flat parameter's pieces) are found by storage: the index keeps the models it was told
    of (``note_module``) or found, weakly, and learns their parameters' and buffers' storages
    lazily, when a tensor that might be one is about to move: one that does not require grad
    (a module's buffer and a plain alias of a parameter never do, and an op's output that does
    is no module's storage) and is not known yet. It then takes the outermost module on the
    Python stack as a model of the scope (a model compiled whole: its wrapper, whose modules are
    the model's), and walks the models' modules again if it has not in this step (``step``, set
    by the Offloader at each outermost entry), so a model moved since (``.to()``) is learned
    anew. So nothing runs per module call, and a step pays a walk only if it moves a tensor
    that does not require grad (the input batch, a frozen backbone's activations, tier keep's
    statistics of a norm). The walk is skipped while each model's first and last parameter or
    buffer, looked up by name, are where they were (``.to()``, ``.half()`` and
    ``load_state_dict(assign=True)`` move them), for at most ``RELEARN_EVERY`` steps: a part of a model moved alone is learned
    by then (until then, a buffer of it saved by an op may be moved, a waste, never a wrong
    gradient). Tier keep's pack in C (held.c) asks the index only at the first such tensor of
    a step; a second model called later in the scope is found only in a step where one of its
    tensors comes first (maybe never), and until then its buffers count as kept activations."""

    def __init__(self, dedup: bool) -> None:
        self.dedup = dedup
        self.step = 0
        self._learned = -1  # the step the parameters were last learned in (or found unmoved)
        self._walked = -1  # the step they were last learned in
        # each model's first and last parameter or buffer as learned: (its module, the table
        # holding it, its name there, its storage's address)
        self._marks: list[tuple[weakref.ref[torch.nn.Module], str, str, int]] = []
        self._models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._saved: dict[tuple[Any, ...], tuple[StorageWeakRef, Any, Block]] = {}
        # By StorageImpl address; held.c's Pack reads it too (tier keep).
        self._params: dict[int, StorageWeakRef] = {}

    # -- parameters (see [parameters learned]) ---------------------------------------------

    def note_module(self, module: torch.nn.Module) -> None:
        """Learn the storages of ``module``'s parameters and buffers, and its submodules', now
        and in later steps."""
        self._models.add(module)
        self._learn_one(module)

    def _learn(self) -> None:
        known = dict(self._params)
        self._params.clear()  # the same dict: held.c's Pack holds it
        self._marks.clear()
        for model in list(self._models):
            self._learn_one(model, known)
        self._learned = self._walked = self.step

    def _learn_one(
        self, model: torch.nn.Module, known: dict[int, StorageWeakRef] | None = None
    ) -> None:
        """Lazy modules' uninitialized parameters and buffers, meta tensors and tensors without
        a storage of their own (functorch wrappers) are skipped, never touched. Attributes are
        read with torch functions off: a torch function mode may be on (the codec's
        ``OpScope``, a user's), and each read would be a call of it in Python. A storage in
        ``known`` keeps its weak reference: it pins the address (see [dedup identity]), so an
        equal address is that same storage, and the cost of a new reference per tensor is saved
        (docs/benchmarks/hooks_cpu-2core_2026-12-05.md)."""
        params = self._params
        first: tuple[torch.nn.Module, str, str, int] | None = None
        last: tuple[torch.nn.Module, str, str, int] | None = None
        with _NoTorchFunction():
            for module in model.modules():
                for table in ("_parameters", "_buffers"):
                    tensors: dict[str, torch.Tensor | None] = getattr(module, table)
                    for name, p in tensors.items():
                        s = _module_storage(p) if p is not None else None
                        if p is None or s is None:
                            continue
                        key = s._cdata
                        last = (module, table, name, key)
                        if first is None:
                            first = last
                        if known is not None and key in known:
                            params[key] = known[key]
                        else:
                            params[key] = StorageWeakRef(s)
        # their storages' addresses stay pinned by ``params``' weak references (see [dedup
        # identity]): an equal address is the same storage
        for mark in (first, last):
            if mark is not None:
                self._marks.append((weakref.ref(mark[0]), *mark[1:]))

    def backs_parameter(self, t: torch.Tensor, facts: Facts) -> bool:
        """Whether ``t`` is a parameter, a view of one, or shares the storage of a parameter or
        buffer of a model in the scope (a buffer, a transposed weight, an FSDP flat parameter);
        ``facts``: what pack asked of it (Note [asked once] in identity.py)."""
        if facts.parameter:
            return True
        storage = facts.storage
        if storage is None or t.requires_grad:
            return False  # an op's output, or a leaf input: no module's storage
        if self._known(storage):
            return True
        model = outermost_module()
        if model is not None and model not in self._models:
            self._models.add(model)
            self._learned = -1
        if self._learned == self.step:
            return False
        if self._learned >= 0 and self._unmoved():
            self._learned = self.step
            return False
        self._learn()
        return self._known(storage)

    def _unmoved(self) -> bool:
        """Whether the models' marks are where they were, within ``RELEARN_EVERY`` steps."""
        if self.step - self._walked >= RELEARN_EVERY:
            return False
        with _NoTorchFunction():
            for ref, table, name, cdata in self._marks:
                module = ref()
                p = None if module is None else getattr(module, table).get(name)
                s = None if p is None else _module_storage(p)
                if s is None or s._cdata != cdata:
                    return False  # moved, replaced (an assign, a new Parameter) or gone
        return True

    def _known(self, storage: torch.UntypedStorage) -> bool:
        ref = self._params.get(storage._cdata)
        return ref is not None and not ref.expired()

    # -- saved storages (see [dedup identity]) ---------------------------------------------

    @staticmethod
    def key(t: torch.Tensor, facts: Facts) -> tuple[Any, ...]:
        assert facts.storage is not None
        return (t.device, facts.storage._cdata, t._version, t.dtype)

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
