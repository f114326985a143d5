"""PyTorch's own corpora (``op_db``, ``module_db``) run with and without offloadd.

Every op of ``torch.testing._internal.common_methods_invocations.op_db`` that supports autograd
(and, as an entry of its own named ``op_``, its in-place variant where it has one that supports
autograd: in-place ops are where version counters move) and every module of ``torch.testing._internal.common_modules.module_db`` runs on PyTorch's own
sample inputs twice from the same RNG seed: once plainly (the reference) and once inside an
Offloader with ``min_bytes=0``, so that every saved tensor goes through pack and unpack. Used by
tests/properties/test_corpus.py and by scripts/corpus_sweep.py.

The comparison rule
-------------------
* **Inputs.** Each run gets fresh copies of the sample's tensors, with the sample's exact size,
  stride, storage offset and overlap. A copy of a tensor that requires grad is a non-leaf (the
  identity :class:`_Fresh`), as activations are, and can be changed in place by an in-place
  variant. Gradients are taken with respect to the sample's own leaves, through that identity.
* **RNG.** The CPU generator is seeded with ``SEED`` before the samples are made and before each
  forward, so random ops (dropout, rrelu, bernoulli) draw the same numbers in both runs.
* **Gradients.** ``torch.autograd.grad`` of every output that requires grad, each with a fixed
  seeded random tensor of its shape as grad_output (the gradient of ``sum(out * w)`` for every
  output, with no reduction that could be reordered), with respect to every input that requires
  grad and, for modules, every parameter (``allow_unused=True``). Modules run in training mode.
  With offloadd, ``synchronize()`` runs between forward and backward, so offloaded bytes come
  back from disk rather than from staging.
* **Equality.** Every forward output (integer ones too) and every gradient must be bit-identical:
  same dtype, same shape, and each element the same bits, except that a NaN equals a NaN whatever
  its payload. ``-0.0`` and ``+0.0`` differ. A gradient that is None must be None in both runs.
* **Skips** carry a reason: the sample raises without offloadd (the exception), it has no output
  that requires grad, or the run with offloadd differed and so does one of up to ``RERUNS`` more
  runs without it ("nondeterministic without offloadd"). Those runs are only made once a run
  with offloadd differed; a sample that varies rarely may need several (``linalg.lstsq``'s gelsy
  driver read uninitialised memory and changed a last bit in about one run in ten, until both
  runs used ``torch.use_deterministic_algorithms(True, warn_only=True)``, which fills new tensors
  and picks deterministic kernels where there are any; every run of :func:`check` uses it).
* **Release.** After each run with offloadd, once its graph is gone, the Offloader must hold
  nothing (``resident_bytes`` and ``disk_bytes`` 0 after ``synchronize()``) and no write may have
  fallen back to memory.
"""

from __future__ import annotations

import gc
import itertools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_modules import module_db

from offloadd import Offloader
from tests._support.corpus_run import (
    Result,
    backward,
    deterministic,
    fresh_inputs,
    result_difference,
    scope,
    seed_rng,
)
from tests._support.helpers import small_offloader

RERUNS = 10  # runs without offloadd that tell a nondeterministic sample from a wrong one
DTYPES = (torch.float64, torch.float32, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Config:
    """One way of running offloadd: tier, dedup, and the embedded engine or a daemon."""

    tier: Literal["ssd", "cpu"]
    dedup: bool
    daemon: bool = False

    def __str__(self) -> str:
        where = "daemon" if self.daemon else self.tier
        return f"{where}-{'dedup' if self.dedup else 'nodedup'}"


CONFIGS = (
    Config("ssd", True),
    Config("ssd", False),
    Config("cpu", True),
    Config("cpu", False),
    Config("ssd", True, daemon=True),
)
PRIMARY = CONFIGS[0]

# Sizes so that the small tensors of the corpora still span several chunks and fill the staging
# pool (backpressure), and backward prefetches.
OFFLOADER_SIZES: dict[str, int] = dict(
    chunk_bytes=4096, staging_bytes=64 << 10, prefetch_bytes=16 << 10, io_threads=2
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class OpSample:
    """One ``SampleInput`` of an ``OpInfo``, run as the op's gradient tests run it."""

    op: Any
    sample: Any
    inplace: bool = False

    def run(self, off: Offloader | None) -> Result:
        s = self.sample
        (inp, args, kwargs), wrt = fresh_inputs(s.input, s.args, s.kwargs)
        fn = self.op.get_inplace() if self.inplace else self.op.get_op()
        seed_rng()
        with scope(off):
            out = self.op.gradcheck_wrapper(fn, inp, *args, **kwargs)
            out = s.output_process_fn_grad(out)
        return backward(out, wrt, off)


@dataclass
class ModuleSample:
    """One ``ModuleInput`` of a ``ModuleInfo``: a module built from the seed, in training mode."""

    info: Any
    module_input: Any
    dtype: torch.dtype

    def run(self, off: Offloader | None) -> Result:
        ctor, fwd = self.module_input.constructor_input, self.module_input.forward_input
        seed_rng()
        module = self.info.module_cls(*ctor.args, **ctor.kwargs).to(self.dtype).train()
        (args, kwargs), wrt = fresh_inputs(fwd.args, fwd.kwargs)
        seed_rng()
        with scope(off):
            out = module(*args, **kwargs)
        # after forward: lazy modules materialize their parameters there
        wrt += [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        return backward(out, wrt, off)


Sample = OpSample | ModuleSample


# -- the corpora ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One op (with its variant) or one module of the corpora."""

    kind: Literal["op", "inplace", "module"]
    name: str
    info: Any = field(compare=False, repr=False)

    def dtypes(self) -> list[torch.dtype]:
        if self.kind != "module":
            supported = self.info.supported_backward_dtypes("cpu")
        else:
            supported = set(self.info.dtypes)
        return [d for d in DTYPES if d in supported]

    def samples(self, dtype: torch.dtype, limit: int | None = None) -> list[Sample]:
        """The first ``limit`` samples (all by default); the same ones on every call."""
        seed_rng()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "sparse CSR support is in beta"
            return self._make_samples(dtype, limit)

    def _make_samples(self, dtype: torch.dtype, limit: int | None) -> list[Sample]:
        if self.kind != "module":
            # What op.sample_inputs() returns, without its wrapper, whose inspect.stack() per call
            # cost two thirds of the default run. Seeded once here rather than per sample.
            made = self.info.sample_inputs_func(self.info, "cpu", dtype, requires_grad=True)
            inplace = self.kind == "inplace"
            return [OpSample(self.info, s, inplace) for s in itertools.islice(made, limit)]
        made = self.info.module_inputs_func(
            self.info, device="cpu", dtype=dtype, requires_grad=True, training=True
        )
        kept = (m for m in made if m.forward_input is not None)
        return [ModuleSample(self.info, m, dtype) for m in itertools.islice(kept, limit)]


def entries() -> list[Entry]:
    """Every op of op_db that supports autograd, then the in-place variants of those that have
    one supporting autograd, then every module of module_db."""
    with_grad = [op for op in op_db if op.supports_autograd]
    ops = [Entry("op", _op_name(op), op) for op in with_grad]
    inplace = [
        Entry("inplace", _op_name(op, "_"), op)
        for op in with_grad
        if op.inplace_variant is not None and op.supports_inplace_autograd
    ]
    return ops + inplace + [Entry("module", m.name, m) for m in module_db]


def _op_name(op: Any, suffix: str = "") -> str:
    name = op.name + suffix
    return f"{name}.{op.variant_test_name}" if op.variant_test_name else name


# -- checking ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Literal["passed", "failed", "skipped"]
    reason: str = ""


def describe_exception(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first if len(first) <= 200 else first[:199] + '…'}"


def _leftover(off: Offloader, fallbacks_before: int) -> str | None:
    """What the Offloader still holds once the sample's graph is gone, if anything."""
    for attempt in range(2):
        off.synchronize()
        st = off.stats()
        if not (st.resident_bytes or st.disk_bytes) or attempt:
            break
        gc.collect()  # a reference cycle in the op's own graph may hold the saved tensors
    problems = [
        f"{k} {v}"
        for k, v in (("resident_bytes", st.resident_bytes), ("disk_bytes", st.disk_bytes))
        if v
    ]
    if st.fallbacks > fallbacks_before:
        problems.append(f"{st.fallbacks - fallbacks_before} write(s) fell back to memory")
    return "left behind: " + ", ".join(problems) if problems else None


class OffloaderPool:
    """One Offloader per configuration, reused across samples (creating one is costly)."""

    def __init__(self, disk_dir: Path, daemon_socket: Callable[[], str]) -> None:
        self.disk_dir = disk_dir
        self._daemon_socket = daemon_socket
        self._live: dict[Config, Offloader] = {}

    def get(self, config: Config) -> Offloader:
        if config not in self._live:
            self._live[config] = small_offloader(
                self.disk_dir,
                tier=config.tier,
                dedup=config.dedup,
                min_bytes=0,
                daemon={"socket": self._daemon_socket() if config.daemon else ""},
                **OFFLOADER_SIZES,
            )
        return self._live[config]

    def discard(self, config: Config) -> None:
        """Close ``config``'s Offloader (it holds something it should not); the next is new."""
        off = self._live.pop(config, None)
        if off is not None:
            off.close()

    def close(self) -> None:
        for config in list(self._live):
            self.discard(config)


class _Reference:
    """The run without offloadd, and whether the sample gives the same result every time."""

    def __init__(self, sample: Sample, result: Result) -> None:
        self.sample = sample
        self.result = result
        self._checked = False
        self._varies: str | None = None

    def varies(self) -> str | None:
        """Why runs without offloadd disagree (None: ``RERUNS`` more runs matched the first).
        Made only once a run with offloadd differed, and once per sample."""
        if not self._checked:
            self._checked = True
            for _ in range(RERUNS):
                try:
                    again = self.sample.run(None)
                except Exception as e:
                    self._varies = f"a run without offloadd raises: {describe_exception(e)}"
                    break
                if result_difference(self.result, again) is not None:
                    self._varies = "nondeterministic without offloadd"
                    break
        return self._varies


def _check_with(sample: Sample, ref: _Reference, off: Offloader) -> Outcome:
    fallbacks = off.stats().fallbacks
    try:
        got: Result | None = sample.run(off)
    except Exception as e:
        got, error = None, f"raises with offloadd: {describe_exception(e)}"
    leak = _leftover(off, fallbacks)  # the exception (and the graph it holds) is gone here
    if got is None:
        return Outcome("failed", error + (f"; {leak}" if leak else ""))
    if leak is not None:
        return Outcome("failed", leak)
    diff = result_difference(ref.result, got)
    if diff is None:
        return Outcome("passed")
    if (why := ref.varies()) is not None:
        return Outcome("skipped", why)
    return Outcome("failed", diff)


def check(sample: Sample, pool: OffloaderPool, configs: Iterable[Config]) -> dict[Config, Outcome]:
    """Run ``sample`` without offloadd, then under each configuration, and compare."""
    configs = list(configs)
    with warnings.catch_warnings(), deterministic():
        warnings.simplefilter("ignore")  # the corpora warn a lot; offloadd's fallbacks are counted
        try:
            ref = _Reference(sample, sample.run(None))
        except Exception as e:
            skip = Outcome("skipped", f"raises without offloadd: {describe_exception(e)}")
            return dict.fromkeys(configs, skip)
        if ref.result.grads is None:
            return dict.fromkeys(configs, Outcome("skipped", "no output requires grad"))
        outcomes = {}
        for config in configs:
            outcomes[config] = _check_with(sample, ref, pool.get(config))
            if outcomes[config].reason.startswith("left behind"):
                pool.discard(config)  # the next sample starts from a clean Offloader
        return outcomes


@dataclass(frozen=True, slots=True)
class Record:
    """One (entry, dtype, sample, configuration) of a sweep and its outcome."""

    entry: str
    kind: str
    config: str
    dtype: str
    sample: int  # -1: the entry has no sample for this dtype, or making them raised
    status: str
    reason: str


def sweep_entry(
    entry: Entry,
    pool: OffloaderPool,
    configs: list[Config] | tuple[Config, ...] = CONFIGS,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    max_samples: int | None = None,
) -> list[Record]:
    """Every sample of ``entry`` in every dtype it supports (of ``dtypes``) under ``configs``."""
    records: list[Record] = []

    def note(config: Config, dtype: str, index: int, outcome: Outcome) -> None:
        records.append(
            Record(
                entry.name, entry.kind, str(config), dtype, index, outcome.status, outcome.reason
            )
        )

    supported = [d for d in entry.dtypes() if d in dtypes]
    if not supported:
        for config in configs:
            note(config, "none", -1, Outcome("skipped", no_dtype_reason(dtypes)))
    for dtype in supported:
        try:
            samples = entry.samples(dtype, max_samples)
        except Exception as e:
            samples, why = [], f"making the samples raises: {describe_exception(e)}"
        else:
            why = "no sample inputs"
        if not samples:
            for config in configs:
                note(config, dtype_name(dtype), -1, Outcome("skipped", why))
        for index, sample in enumerate(samples):
            for config, outcome in check(sample, pool, configs).items():
                note(config, dtype_name(dtype), index, outcome)
    return records


def no_dtype_reason(dtypes: tuple[torch.dtype, ...] = DTYPES) -> str:
    return f"no backward in {'/'.join(dtype_name(d) for d in dtypes)} on CPU"
