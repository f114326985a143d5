"""The codec in the pack path: which saved tensors it encodes, the handle it returns, dedup.

Note: [codes through the tiers] A tensor the codec takes (see [what gets compressed] in
allowlist.py) is encoded inside pack on its own device (on a GPU before any copy to the host),
and its codes and ranges are then saved like any other tensor: :class:`Codec` hands both to the
exact pack path, which keeps them (tier keep: compressed in memory), moves them to the host pool or writes
them to files (tiers cpu and ssd, embedded engine or daemon), and counts them for the planner
of a budget, which so plans with the compressed sizes. Unpack brings both back through the same
path, decodes, and returns a tensor of the saved one's dtype, shape and strides.

A storage saved twice by allowed ops (the same layer-norm output read by three projections) is
encoded once: the key is the one of [dedup identity] in runtime/dedup.py plus the view's
geometry, and the handle is shared while it lives. A storage already saved exactly (by an op not
in the list, say) is not encoded again: the exact copy is referenced instead, which costs
nothing more. Stochastic rounding draws from one generator per device, seeded at each step's
first forward from ``codec.seed`` and the step number, so two runs with the same seed round the
same way.

Note: [the exact-save table] :meth:`Codec.note_exact` remembers the storages saved exactly, one
entry per storage holding the version it was last saved at: versions only grow, so a later save
is never at an older one, and a save at another version than the entry's is not of the bytes
held. Parameters and their views are never noted (the codec never encodes them anyway). Keyed on
the version, as it was, every weight whose view linear saves (``weight.t()``) added an entry at
each step, as ``optimizer.step()`` bumps its version; its storage lives on, so begin_step's
prune never dropped one and walked them all (a two-layer MLP: 200 entries, 53 KB after 200
steps; a real model, an entry per weight per step). Now there is at most one entry per live
storage, pruned at the next step once the storage or its root is gone. ``_saved``, the coded
handles shared by [codes through the tiers], keeps an entry only while its handle lives (the
graph holds it), so it is bounded by what one step saves.

Note: [non-finite values] A tensor that holds an infinity or a NaN (or a magnitude past the edge
of [the codes] in quant.py, where a decoded value could overflow) is saved exactly: pack encodes
it, sees from :attr:`~offloadd.codec.quant.Encoded.finite` that a group's range is not finite,
drops the codes and returns None. Coded, its group would decode to NaN as a whole, and a NaN
where exact training had a finite value poisons every gradient it reaches: sdpa saves the float
copy of 0 and -inf it makes of a bool mask, and q, k and v's gradients all turned NaN, with a
forward loss still exact, so nothing showed until the optimizer step (a GradScaler silently
skipped every step). Saved exactly, the non-finite values reach backward as they would without
offloadd, and gradients are finite wherever exact training's are. The ranges that find it are
the ones the encoder computes anyway (per-group minimum and maximum, in the fused kernel and the
torch ops alike), so a finite tensor pays nothing; on CUDA reading the flag is a sync with the
device, once per coded tensor. A non-finite one pays for an encode it throws away.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offloadd.codec.allowlist import DEFAULT_OPS, OpScope, kept_exact, saved_shapes, unknown_ops
from offloadd.codec.quant import Encoded, Scheme, coded_nbytes, decode, encode, group_size
from offloadd.runtime.identity import Facts, describe, inplace_error, version_handle

if TYPE_CHECKING:
    from offloadd.config import Config

__all__ = ["Codec", "Coded", "dense_order"]

_FLOATING = (torch.float32, torch.bfloat16, torch.float16)


class Coded:
    """What pack returns for an encoded tensor: the exact path's handles of its codes and
    ranges, and what rebuilds it."""

    __slots__ = (
        "__weakref__",
        "codes",
        "desc",
        "dtype",
        "group",
        "handle",
        "inverse",
        "numel",
        "params",
        "shape",
        "version",
    )

    def __init__(
        self, t: torch.Tensor, perm: tuple[int, ...], enc: Encoded, pack_codes: Any, pack: Any
    ) -> None:
        self.codes = pack_codes(enc.codes)
        self.params = pack(enc.params)  # a 64th of the codes or less: as any small tensor
        self.numel = enc.numel
        self.group = enc.group
        self.dtype = t.dtype
        self.shape = tuple(t.shape[i] for i in perm)  # as encoded: in memory order
        self.inverse = tuple(sorted(range(len(perm)), key=perm.__getitem__))
        self.version = t._version
        self.handle = version_handle(t)
        self.desc = describe(t)


def dense_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of ``t``'s dims that makes it contiguous, or None (overlapping, gaps)."""
    stride, size = t.stride(), t.shape
    perm = tuple(sorted(range(t.dim()), key=lambda d: (-stride[d], -size[d])))
    return perm if t.permute(perm).is_contiguous() else None


def layout_for(t: torch.Tensor, storage: torch.UntypedStorage) -> tuple[int, ...] | None:
    """How ``t`` is encoded: the permutation that makes it contiguous (encoded in memory order,
    decoded to the same strides), the identity for a view with gaps (a slice of a fused
    projection's output: encoded from a contiguous copy, decoded contiguous), or None for a
    view that repeats elements (an expand: a copy would be larger than what it saves)."""
    perm = dense_order(t)
    if perm is not None:
        return perm
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True)):
        return None
    if t.nbytes > storage.nbytes():
        return None
    return tuple(range(t.dim()))


def _same_storage(entry: tuple[Any, ...], facts: Facts) -> bool:
    """Whether a registry entry ``(StorageWeakRef, weakref to the root, ...)`` found under a
    tensor's key still stands for its storage (see [dedup identity] in runtime/dedup.py)."""
    return not entry[0].expired() and entry[1]() is facts.root


class Codec:
    """Encodes the saved tensors it may in pack and decodes them in unpack (one Offloader's):
    the :class:`~offloadd.runtime.stages.Coder` stage of the pack path."""

    handle_type = Coded

    def __init__(self, cfg: Config) -> None:
        settings = cfg.codec
        self.scheme = Scheme(
            settings.name,
            group=settings.group,
            symmetric=settings.symmetric,
            stochastic=settings.stochastic,
        )
        self.min_bytes = max(settings.min_bytes, 1)
        self.ops = frozenset(settings.ops) if settings.ops else frozenset(DEFAULT_OPS)
        unknown = unknown_ops(self.ops)
        if unknown:
            raise ValueError(
                f"codec.ops: {', '.join(map(repr, unknown))} is no torch function, "
                "torch.nn.functional function or tensor method"
            )
        self.seed = settings.seed
        self.step = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self._saved: dict[tuple[Any, ...], tuple[StorageWeakRef, Any, Any]] = {}
        # (device, StorageImpl address) -> (its weak ref, the root's, version last saved at)
        self._exact: dict[tuple[Any, ...], tuple[StorageWeakRef, Any, int]] = {}
        self.coded_tensors = 0
        self.coded_in_bytes = 0
        self.coded_out_bytes = 0

    def note_stats(self, stats: Any) -> None:
        stats.coded_tensors = self.coded_tensors
        stats.coded_in_bytes = self.coded_in_bytes
        stats.coded_out_bytes = self.coded_out_bytes

    def scope(self) -> OpScope:
        """The torch function mode that tells pack which op saves (enter it per thread)."""
        return OpScope(self.ops, self.scheme.name)

    def begin_step(self) -> None:
        """A step's first forward: reseed stochastic rounding, drop dead dedup entries."""
        self.step += 1
        for gen in self._generators.values():
            gen.manual_seed(self._seed())
        self._saved = {k: v for k, v in self._saved.items() if v[2]() is not None}
        self._exact = {
            k: v for k, v in self._exact.items() if not v[0].expired() and v[1]() is not None
        }

    def _seed(self) -> int:
        return (self.seed * 1_000_003 + self.step) & ((1 << 63) - 1)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if not self.scheme.stochastic:
            return None
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self._seed())
        return gen

    # -- pack ------------------------------------------------------------------------------

    def wants(self, t: torch.Tensor) -> bool:
        """Whether ``t``, being saved now, is one the codec encodes (see allowlist.py)."""
        shapes = saved_shapes()
        return (
            shapes is not None
            and type(t) is torch.Tensor
            and t.dtype in _FLOATING
            and t.layout is torch.strided
            and t.nbytes >= self.min_bytes
            and t.shape in shapes
            and t.device.type in ("cpu", "cuda")
            and not t.is_conj()
            and not t.is_neg()
            and not isinstance(t._base, torch.nn.Parameter)
            and not kept_exact(t)
        )

    def note_exact(self, t: torch.Tensor, facts: Facts | None = None) -> None:
        """``t`` was just saved exactly: a later save of its storage by an allowed op is not
        encoded (that would add a copy and an error to bytes already held). One entry per
        storage, at the version it was last saved at (see [the exact-save table]). ``facts``:
        what pack asked of ``t`` already, if it did (Note [asked once] in identity.py)."""
        if (
            type(t) is torch.Tensor
            and t.dtype in _FLOATING
            and t.layout is torch.strided
            and t.nbytes >= self.min_bytes
        ):
            if facts is None:
                facts = Facts(t)
            storage = facts.storage
            if storage is not None and not facts.parameter:
                entry = (StorageWeakRef(storage), weakref.ref(facts.root), t._version)
                self._exact[t.device, storage._cdata] = entry

    def saved_exactly(self, t: torch.Tensor, facts: Facts) -> bool:
        """Whether ``t``'s storage, at its version, was saved exactly (see :meth:`note_exact`)."""
        if not self._exact or facts.storage is None:
            return False
        hit = self._exact.get((t.device, facts.storage._cdata))
        return hit is not None and hit[2] == t._version and _same_storage(hit, facts)

    def pack(
        self,
        t: torch.Tensor,
        facts: Facts,
        pack_codes: Callable[[torch.Tensor], Any],
        pack_exact: Callable[[torch.Tensor], Any],
    ) -> Coded | None:
        """The coded handle of ``t`` (shared with an earlier save of the same view), or None
        when ``t`` is not to be encoded (see :func:`layout_for`) and is saved exactly. The
        codes are saved with ``pack_codes``, the ranges with ``pack_exact``; ``facts``: what
        pack asked of ``t`` (Note [asked once] in identity.py)."""
        storage = facts.storage
        perm = layout_for(t, storage) if storage is not None else None
        if perm is None or storage is None:
            return None
        key = (
            t.device,
            storage._cdata,
            t._version,
            t.dtype,
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
        )
        hit = self._saved.get(key)
        if hit is not None and _same_storage(hit, facts):
            coded = hit[2]()
            if coded is not None:
                return coded
        shape = tuple(t.shape[d] for d in perm)
        group = group_size(shape, self.scheme.group)
        if coded_nbytes(t.numel(), self.scheme, group) >= t.nbytes:
            return None  # shorter than a group or two: the codes would not be smaller
        x = t.detach().permute(perm).contiguous()  # a copy only for a view with gaps
        enc = encode(x, self.scheme, group, self._generator(t.device))
        if not enc.finite:
            return None  # see [non-finite values]
        coded = Coded(t, perm, enc, pack_codes, pack_exact)
        self._saved[key] = (StorageWeakRef(storage), weakref.ref(facts.root), weakref.ref(coded))
        self.coded_tensors += 1
        self.coded_in_bytes += t.nbytes
        self.coded_out_bytes += enc.codes.nbytes + enc.params.nbytes
        return coded

    # -- unpack ----------------------------------------------------------------------------

    def unpack(self, coded: Coded, unpack_exact: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The decoded tensor, of the saved one's dtype and shape, and its strides unless it was
        a view with gaps (then contiguous)."""
        h = coded.handle
        if h is not None and h._version != coded.version:
            raise inplace_error(coded.desc, coded.version, h._version)
        enc = Encoded(
            codes=unpack_exact(coded.codes),
            params=unpack_exact(coded.params),
            numel=coded.numel,
            group=coded.group,
        )
        flat = decode(enc, self.scheme, coded.dtype)
        return flat.view(coded.shape).permute(coded.inverse)
