"""The op corpus: every OpInfo of op_db with a float32 CPU backward, its vector-Jacobian product
plain and under each codec (modes default, forced and forced-g16), and the cases as compact JSON."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from offloadd import Offloader
from tests._support.corpus_run import deterministic, tensors_in

from .common import (
    cotangent,
    error_of,
    fresh_inputs,
    identical,
    log,
    seed_rng,
)


class OuterNames(TorchFunctionMode):
    """Records the names of the torch functions called at the outermost level (as OpScope sees
    them: the mode is off while one runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", None)
        if isinstance(name, str) and name.isidentifier():
            self.names.add(name)
        return func(*args, **(kwargs or {}))


class NoGrad(Exception):
    pass


@dataclass
class OpRun:
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]


def run_sample(op: Any, sample: Any, off: Offloader | None, names: OuterNames | None) -> OpRun:
    (inp, args, kwargs), leaves = fresh_inputs(sample.input, sample.args, sample.kwargs)
    seed_rng()
    with off if off is not None else contextlib.nullcontext():
        with names if names is not None else contextlib.nullcontext():
            out = op.gradcheck_wrapper(op.get_op(), inp, *args, **kwargs)
        out = sample.output_process_fn_grad(out)
    outputs = tensors_in(out)
    diff = [t for t in outputs if t.requires_grad]
    if not diff or not leaves:
        raise NoGrad
    cots = [cotangent(t, i) for i, t in enumerate(diff)]
    grads = torch.autograd.grad(diff, leaves, cots, allow_unused=True)
    return OpRun([t.detach() for t in outputs], list(grads))


def known_ops(names: set[str]) -> list[str]:
    """``names`` less those ``codec_ops`` refuses (no torch function: ``__get__`` of a property)."""
    try:
        from offloadd.codec.allowlist import unknown_ops
    except ImportError:  # an older offloadd accepts any name
        return list(names)
    unknown = set(unknown_ops(names))
    return [n for n in names if n not in unknown]


def op_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def corpus_ops(only: Sequence[str]) -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [
        op
        for op in op_db
        if op.supports_autograd and torch.float32 in op.supported_backward_dtypes("cpu")
    ]
    if only:
        wanted = set(only)
        ops = [op for op in ops if op_name(op) in wanted]
    return ops


def _exc(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first[:160]}"


@dataclass
class OpCase:
    """One (op, codec, mode) over the op's samples: the worst error of any sample."""

    op: str
    codec: str
    mode: str
    samples: int = 0
    coded_tensors: int = 0
    rel_l2: float = 0.0
    max_rel: float = 0.0
    new_nonfinite: int = 0
    failures: list[str] = field(default_factory=list)


SMALL_GROUP = 16
"""``codec_group`` of the mode ``forced-g16``: op_db's tensors are mostly smaller than a default
group, and a tensor is coded only where its codes are smaller than it."""


def _offloader(codec: str, ops: Sequence[str], min_bytes: int, group: int = 256) -> Offloader:
    return Offloader(
        tier="keep",
        codec={"name": codec, "min_bytes": min_bytes, "ops": tuple(ops), "group": group},
    )


def op_corpus(
    codecs: Sequence[str], max_samples: int, only: Sequence[str], small_group: bool = True
) -> dict[str, Any]:
    """Runs the corpus; returns the cases, the skips, and which functions forced mode coded."""
    ops = corpus_ops(only)
    cases: dict[tuple[str, str, str], OpCase] = {}
    skipped: dict[str, str] = {}  # op -> why no sample of it counted
    sample_skips: dict[str, int] = {}
    forced_names: dict[str, list[str]] = {}
    lossy = [c for c in codecs if c != "none"]
    start = time.monotonic()
    for i, op in enumerate(ops):
        name = op_name(op)
        if i % 25 == 0:
            log(f"[ops] {i}/{len(ops)} {name} ({time.monotonic() - start:.0f} s)")
        try:
            seed_rng()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made = op.sample_inputs_func(op, "cpu", torch.float32, requires_grad=True)
                samples = list(itertools.islice(made, max_samples))
        except Exception as e:
            skipped[name] = f"making the samples raises: {_exc(e)}"
            continue
        if not samples:
            skipped[name] = "no float32 sample"
            continue
        counted = 0
        reasons: list[str] = []
        names_seen: set[str] = set()
        for sample in samples:
            with warnings.catch_warnings(), deterministic():
                warnings.simplefilter("ignore")
                outcome = _check_sample(op, sample, codecs, lossy, name, cases, small_group)
            if isinstance(outcome, str):
                reasons.append(outcome)
                sample_skips[outcome.split(":")[0]] = sample_skips.get(outcome.split(":")[0], 0) + 1
                continue
            counted += 1
            names_seen |= outcome
        if not counted:
            skipped[name] = reasons[0] if reasons else "no sample"
        else:
            forced_names[name] = sorted(names_seen)
    log(f"[ops] done: {len(ops)} ops in {time.monotonic() - start:.0f} s")
    return {
        "ops_considered": len(ops),
        **compact_cases([asdict(c) for c in cases.values()]),
        "skipped_ops": skipped,
        "skipped_samples_by_reason": sample_skips,
        "forced_codec_ops": forced_names,
        "seconds": time.monotonic() - start,
    }


CASE_FIELDS = (
    "op",
    "codec",
    "mode",
    "samples",
    "coded_tensors",
    "rel_l2",
    "max_rel",
    "new_nonfinite",
    "failures",
)


def compact_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The cases as rows of ``CASE_FIELDS`` (errors to 6 significant digits), without those
    where nothing was coded and nothing happened (an op counted but absent from the rows with a
    codec and mode had nothing coded, error 0), so that the JSON stays small."""
    rows = [
        [round_sig(c[f]) if isinstance(c[f], float) else c[f] for f in CASE_FIELDS]
        for c in cases
        if c["coded_tensors"] or c["rel_l2"] or c["max_rel"] or c["new_nonfinite"] or c["failures"]
    ]
    return {"case_fields": list(CASE_FIELDS), "cases": rows}


def expand_cases(ops: dict[str, Any]) -> list[dict[str, Any]]:
    """The cases of :func:`compact_cases` as dicts (also reads the older list of dicts)."""
    fields = ops.get("case_fields")
    if fields is None:
        return list(ops["cases"])
    return [dict(zip(fields, row, strict=True)) for row in ops["cases"]]


def dump_json(res: dict[str, Any]) -> str:
    """``res`` as JSON, indented, with each row of the op cases on one line."""
    rows = res.get("ops", {}).get("cases", [])
    marker = "__CASE_ROWS__"
    text = json.dumps({**res, "ops": {**res.get("ops", {}), "cases": marker}}, indent=1)
    lines = ",\n  ".join(json.dumps(r) for r in rows)
    return text.replace(f'"{marker}"', f"[\n  {lines}\n ]" if rows else "[]") + "\n"


def round_sig(x: float) -> float:
    return x if not math.isfinite(x) or x == 0 else float(f"{x:.6g}")


def _check_sample(
    op: Any,
    sample: Any,
    codecs: Sequence[str],
    lossy: Sequence[str],
    name: str,
    cases: dict[tuple[str, str, str], OpCase],
    small_group: bool,
) -> set[str] | str:
    """One sample under every codec and mode; the names forced mode used, or why it was
    skipped."""
    names = OuterNames()
    try:
        ref = run_sample(op, sample, None, names)
    except NoGrad:
        return "no output requires grad"
    except Exception as e:
        return f"raises without offloadd: {_exc(e)}"
    try:
        again = run_sample(op, sample, None, None)
    except Exception as e:
        return f"raises without offloadd (second run): {_exc(e)}"
    if not (identical(ref.outputs, again.outputs) and identical(ref.grads, again.grads)):
        return "nondeterministic without offloadd"
    forced = sorted(known_ops(names.names))
    runs: list[tuple[str, str, Sequence[str]]] = []
    if "none" in codecs:
        runs.append(("none", "default", ()))
    for codec in lossy:
        runs.append((codec, "default", ()))
        runs.append((codec, "forced", forced))
        if small_group:
            runs.append((codec, "forced-g16", forced))
    for codec, mode, ops in runs:
        case = cases.setdefault((name, codec, mode), OpCase(name, codec, mode))
        off = _offloader(codec, ops, 1, SMALL_GROUP if mode == "forced-g16" else 256)
        try:
            got = run_sample(op, sample, off, None)
            coded = off.stats().coded_tensors
            if not identical(ref.outputs, got.outputs):
                case.failures.append("forward output differs")
            err = error_of(ref.grads, got.grads)
        except Exception as e:
            case.failures.append(f"raises with the codec: {_exc(e)}")
            continue
        finally:
            off.close()
        case.samples += 1
        case.coded_tensors += coded
        case.new_nonfinite += err.new_nonfinite
        case.rel_l2 = max(case.rel_l2, err.rel_l2)
        case.max_rel = max(case.max_rel, err.max_rel)
    return set(forced)


# -- probes: allowed ops on hard inputs --------------------------------------------------------
