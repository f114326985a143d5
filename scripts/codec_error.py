#!/usr/bin/env python3
"""How far the lossy codecs (``Config.codec``) move gradients: per op of PyTorch's op_db, on a
few stress inputs, and on small randomly initialised HF models and the built-in mini GPT.

Three parts, each comparing input / parameter gradients computed plainly (the reference) with
the same computation under ``Offloader(tier="keep", codec=...)``:

* **op corpus**: every OpInfo of ``op_db`` with autograd and float32 backward on CPU, its first
  ``--max-samples`` float32 samples; the vector-Jacobian product with a fixed random cotangent
  per output (as tests/corpus.py does). Two modes per lossy codec, both with
  ``codec_min_bytes=1`` so that the corpus's small tensors qualify: *default* (``codec_ops``
  empty: the allow list of offloadd/codec/allowlist.py, what users get) and *forced* (``codec_ops`` =
  every torch function the op's forward calls at the outermost level, normally just the op
  itself: every floating saved tensor with an argument's shape is coded).
* **probes**: a few allowed ops on inputs chosen to be hard for per-group ranges (a large common
  offset, one outlier channel, peaky softmax), default allow list, default ``codec_min_bytes``.
* **models**: one training step's parameter gradients of GPT-2, BERT, ViT (transformers, small
  configs, random weights, no downloads) and offloadd's mini GPT, all dropout probabilities 0
  (training mode, so the comparison is deterministic: dropout masks would differ otherwise),
  default allow list and ``codec_min_bytes``.

Errors are relative: ``rel_l2 = ||g_codec - g|| / ||g||`` and ``max_rel = max|g_codec - g| /
max|g|`` over all gradients of a case concatenated (elements where the reference is not finite
left out; a new NaN or infinity makes both infinite). Writes ``<name>.md`` and ``<name>.json``.

    python scripts/codec_error.py --out docs/benchmarks
    python scripts/codec_error.py --quick --out /tmp/codec --codecs none,int8
    python scripts/codec_error.py --from-json docs/benchmarks/NAME.json --notes notes.md
        # render the markdown again, the notes becoming its Conclusions (kept in the JSON)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import itertools
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from offloadd import Offloader
from offloadd.codec import CODECS, DEFAULT_OPS

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
LOSSY_DEFAULT = ("none", "int8", "fp8-e4m3", "fp8-e5m2", "int4", "int2")
# The ops that allowlist.py leaves out on purpose (its docstring), matched against op_db names.
DENIED = (
    "max",
    "amax",
    "clamp",
    "nn.functional.relu",
    "nn.functional.threshold",
    "div",
    "log",
    "sqrt",
    "pow",
    "reciprocal",
    "nn.functional.dropout",
    "log_softmax",
    "nn.functional.cross_entropy",
)
QUICK_OPS = (
    "mul",
    "div.no_rounding_mode",
    "log",
    "nn.functional.linear",
    "softmax",
    "nn.functional.layer_norm",
    "nn.functional.gelu",
    "tanh",
    "sigmoid",
    "nn.functional.scaled_dot_product_attention",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def seed_rng() -> None:
    torch.default_generator.manual_seed(SEED)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


# -- errors -----------------------------------------------------------------------------------


@dataclass
class Error:
    """Relative error of a set of gradients against the reference (see the module docstring)."""

    rel_l2: float = 0.0
    max_rel: float = 0.0
    new_nonfinite: int = 0

    def worst(self, other: Error) -> Error:
        return Error(
            max(self.rel_l2, other.rel_l2),
            max(self.max_rel, other.max_rel),
            self.new_nonfinite + other.new_nonfinite,
        )


def _plain(t: torch.Tensor) -> torch.Tensor:
    if t.layout is not torch.strided:
        t = t.to_dense()
    t = t.detach().resolve_conj().resolve_neg()
    return torch.view_as_real(t) if t.is_complex() else t


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    parts = [_plain(t).reshape(-1).to(torch.float64) for t in ts]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def error_of(ref: Sequence[torch.Tensor | None], got: Sequence[torch.Tensor | None]) -> Error:
    """The error of ``got`` against ``ref``, gradient by gradient (None pairs skipped)."""
    if len(ref) != len(got):
        raise ValueError(f"{len(ref)} gradients vs {len(got)}")
    rs, gs = [], []
    for r, g in zip(ref, got, strict=True):
        if (r is None) != (g is None):
            raise ValueError("a gradient is None in one run only")
        if r is not None and g is not None:
            if r.shape != g.shape:
                raise ValueError(f"gradient shapes {list(r.shape)} vs {list(g.shape)}")
            rs.append(r)
            gs.append(g)
    r, g = _flat(rs), _flat(gs)
    finite = torch.isfinite(r)
    new_bad = int((finite & ~torch.isfinite(g)).sum())
    if new_bad:
        return Error(math.inf, math.inf, new_bad)
    r, g = r[finite], g[finite]
    if r.numel() == 0:
        return Error()
    d = g - r
    return Error(
        _ratio(float(d.norm()), float(r.norm())),
        _ratio(float(d.abs().max()), float(r.abs().max())),
    )


def identical(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> bool:
    """Bit-identical tensors (a NaN equals any NaN), None where the other is None."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                return False
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        x, y = _plain(x), _plain(y)
        # -0.0 == +0.0 here: the codecs never touch a forward output anyway
        same = (x == y) | (x.isnan() & y.isnan()) if x.is_floating_point() else x == y
        if not bool(same.all()):
            return False
    return True


# -- the op corpus ----------------------------------------------------------------------------


def _copy_layout(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in a new storage with the same size, stride, offset (and overlap)."""
    if x.layout is not torch.strided or x.is_conj() or x.is_neg():
        return x.detach().clone()
    storage = x.detach().untyped_storage().clone()
    return x.new_empty(0).set_(storage, x.storage_offset(), x.size(), x.stride())


class _Fresh(torch.autograd.Function):
    """Identity whose output is a non-leaf copy of its input: an activation, as in tests/corpus.py
    (an in-place variant in a sample may then change it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _copy_layout(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(o, fn) for o in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def fresh_inputs(*objs: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """Fresh copies of ``objs`` (one per distinct tensor) and the leaves to differentiate."""
    memo: dict[int, torch.Tensor] = {}
    leaves: list[torch.Tensor] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            if t.requires_grad:
                leaves.append(t)
                memo[id(t)] = _Fresh.apply(t)
            else:
                memo[id(t)] = _copy_layout(t)
        return memo[id(t)]

    return [_map(o, copy) for o in objs], leaves


def cotangent(t: torch.Tensor, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + 1000 + index)
    return torch.randn(t.shape, generator=gen, dtype=t.dtype)


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


def _probe_cases(quick: bool) -> list[tuple[str, Callable[[], tuple[Any, list[torch.Tensor]]]]]:
    b, t, d = (2, 32, 256) if quick else (4, 128, 256)

    def ln(x: torch.Tensor) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            m = nn.LayerNorm(d)
            with torch.no_grad():
                m.weight.normal_(1.0, 0.1)
                m.bias.normal_(0.0, 0.1)
            xx = x.clone().requires_grad_()
            return (lambda: m(xx)), [xx, m.weight, m.bias]

        return f

    def lin(x: torch.Tensor) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            m = nn.Linear(d, d)
            xx = x.clone().requires_grad_()
            return (lambda: m(xx)), [xx, m.weight, m.bias]

        return f

    def softmax(scale: float) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            xx = (torch.randn(b, 4, t, t) * scale).requires_grad_()
            return (lambda: torch.softmax(xx, -1)), [xx]

        return f

    def sdpa(scale: float) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            q, k, v = (torch.randn(b, 4, t, 64) for _ in range(3))
            q, k = q * scale, k * scale
            q, k, v = (z.requires_grad_() for z in (q, k, v))
            return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), [q, k, v]

        return f

    def eager(scale: float) -> Callable[[], tuple[Any, list[torch.Tensor]]]:
        def f() -> tuple[Any, list[torch.Tensor]]:
            seed_rng()
            q, k, v = (torch.randn(b, 4, t, 64) for _ in range(3))
            q, k = q * scale, k * scale
            q, k, v = (z.requires_grad_() for z in (q, k, v))
            causal = torch.ones(t, t, dtype=torch.bool).triu(1)

            def attend() -> torch.Tensor:
                s = torch.matmul(q, k.transpose(-2, -1)) / 8.0
                p = torch.softmax(s.masked_fill(causal, -math.inf), -1)
                return torch.matmul(p, v)

            return attend, [q, k, v]

        return f

    g = torch.Generator().manual_seed(SEED)
    plain = torch.randn(b, t, d, generator=g)
    offset = plain + 50.0
    outlier = plain.clone()
    outlier[..., 7] *= 60.0  # one channel 60x the others, as in trained transformers
    return [
        ("layer_norm, N(0,1) input", ln(plain)),
        ("layer_norm, N(0,1) + 5 (common offset)", ln(plain + 5.0)),
        ("layer_norm, N(0,1) + 50 (common offset)", ln(offset)),
        ("layer_norm, one channel x60 (outlier)", ln(outlier)),
        ("linear, N(0,1) input", lin(plain)),
        ("linear, one channel x60 (outlier)", lin(outlier)),
        ("softmax, logits N(0,1)", softmax(1.0)),
        ("softmax, logits N(0,10^2) (peaky)", softmax(10.0)),
        ("sdpa causal, q,k,v N(0,1), head dim 64", sdpa(1.0)),
        ("sdpa causal, q,k x3 (logits std 9)", sdpa(3.0)),
        ("eager attention (matmul, softmax, matmul), q,k,v N(0,1)", eager(1.0)),
        ("eager attention, q,k x3 (logits std 9)", eager(3.0)),
    ]


def probes(codecs: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    out = []
    for label, make in _probe_cases(quick):
        fn, wrt = make()
        seed_rng()
        y = fn()
        cot = cotangent(y, 0)
        ref = torch.autograd.grad(y, wrt, cot)
        row: dict[str, Any] = {"probe": label, "codecs": {}}
        for codec in codecs:
            off = Offloader(tier="keep", codec={"name": codec})
            with off:
                y = fn()
            grads = torch.autograd.grad(y, wrt, cot)
            st = off.stats()
            off.close()
            err = error_of(ref, grads)
            row["codecs"][codec] = {**asdict(err), "coded_tensors": st.coded_tensors}
        out.append(row)
        log(
            f"[probes] {label}: "
            + ", ".join(f"{c} {v['rel_l2']:.2e}" for c, v in row["codecs"].items())
        )
    return out


# -- models -----------------------------------------------------------------------------------


@dataclass
class Model:
    name: str
    what: str
    module: nn.Module
    loss: Callable[[], torch.Tensor]


def _hf_quiet() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def models(quick: bool) -> list[Model]:
    _hf_quiet()
    import transformers as tr

    tr.logging.set_verbosity_error()
    layers, seq, batch = (1, 32, 2) if quick else (2, 128, 4)
    vocab = 1024
    out: list[Model] = []
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)

    for attn in ("sdpa", "eager"):
        seed_rng()
        cfg = tr.GPT2Config(
            vocab_size=vocab,
            n_positions=seq,
            n_embd=256,
            n_layer=layers,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        gpt2 = tr.GPT2LMHeadModel._from_config(cfg, attn_implementation=attn).train()
        out.append(
            Model(
                f"GPT-2 ({attn} attention)",
                f"GPT2LMHeadModel, {layers} layers, n_embd 256, 4 heads, vocab {vocab}, "
                f"batch {batch} x seq {seq}, LM loss",
                gpt2,
                lambda m=gpt2: m(input_ids=ids, labels=ids).loss,
            )
        )

    seed_rng()
    bcfg = tr.BertConfig(
        vocab_size=vocab,
        hidden_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=seq,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    bert = tr.BertForMaskedLM(bcfg).train()
    out.append(
        Model(
            "BERT",
            f"BertForMaskedLM, {layers} layers, hidden 256, 4 heads, ffn 1024, vocab {vocab}, "
            f"batch {batch} x seq {seq}, MLM loss on every token",
            bert,
            lambda m=bert: m(input_ids=ids, labels=ids).loss,
        )
    )

    seed_rng()
    image, vbatch = (32, 2) if quick else (64, 8)
    vcfg = tr.ViTConfig(
        image_size=image,
        patch_size=8,
        hidden_size=192,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=768,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
    )
    vit = tr.ViTForImageClassification(vcfg).train()
    pixels = torch.randn(vbatch, 3, image, image, generator=g)
    labels = torch.randint(0, 10, (vbatch,), generator=g)
    out.append(
        Model(
            "ViT",
            f"ViTForImageClassification, {layers} layers, hidden 192, 4 heads, ffn 768, "
            f"{image}x{image} images, patch 8, batch {vbatch}, 10 classes",
            vit,
            lambda m=vit: m(pixel_values=pixels, labels=labels).loss,
        )
    )

    from offloadd.tools.models.gpt import GPT, GPTConfig

    seed_rng()
    mcfg = GPTConfig(
        vocab_size=vocab, seq_len=seq, num_layers=layers, d_model=256, num_heads=4, dropout=0.0
    )
    mini = GPT(mcfg).train()
    out.append(
        Model(
            "mini GPT (offloadd)",
            f"offloadd.tools.models.gpt, {layers} layers, d_model 256, 4 heads, vocab {vocab}, "
            f"batch {batch} x seq {seq}, dropout 0",
            mini,
            lambda m=mini: m(ids, ids),
        )
    )
    return out


def model_errors(codecs: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    rows = []
    for model in models(quick):
        params = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        wrt = [p for _, p in params]
        t0 = time.monotonic()
        loss = model.loss()
        ref = torch.autograd.grad(loss, wrt, allow_unused=True)
        loss2 = model.loss()
        again = torch.autograd.grad(loss2, wrt, allow_unused=True)
        row: dict[str, Any] = {
            "model": model.name,
            "what": model.what,
            "parameters": sum(p.numel() for p in wrt),
            "loss": loss.item(),
            "deterministic": identical([loss], [loss2]) and identical(ref, again),
            "codecs": {},
        }
        del loss, loss2, again
        # Parameters whose gradient is rounding noise (an attention key bias: softmax is invariant
        # to it, so its exact gradient is 0): a relative error of noise means nothing.
        rms_all = float(_flat([r for r in ref if r is not None]).pow(2).mean().sqrt())
        negligible = {
            n
            for (n, _), r in zip(params, ref, strict=True)
            if r is not None and float(_flat([r]).pow(2).mean().sqrt()) < 1e-4 * rms_all
        }
        row["negligible_grad_params"] = sorted(negligible)
        for codec in codecs:
            off = Offloader(tier="keep", codec={"name": codec})
            with off:
                loss = model.loss()
            st = off.stats()
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
            off.close()
            err = error_of(ref, grads)
            per_param = [
                (n, error_of([r], [g]))
                for (n, _), r, g in zip(params, ref, grads, strict=True)
                if r is not None and n not in negligible
            ]
            worst_name, worst = max(per_param, key=lambda x: x[1].rel_l2)
            row["codecs"][codec] = {
                **asdict(err),
                "loss_identical": loss.item() == row["loss"],
                "worst_param": worst_name,
                "worst_param_rel_l2": worst.rel_l2,
                "worst_param_max_rel": max(e.max_rel for _, e in per_param),
                "saved_bytes": st.saved_bytes,
                "peak_resident_bytes": st.peak_resident_bytes,
                "coded_tensors": st.coded_tensors,
                "coded_in_bytes": st.coded_in_bytes,
                "coded_out_bytes": st.coded_out_bytes,
            }
            del loss, grads
        base = row["codecs"].get("none")
        for v in row["codecs"].values():
            v["saved_ratio"] = _ratio(v["saved_bytes"], base["saved_bytes"]) if base else None
            v["peak_ratio"] = (
                _ratio(v["peak_resident_bytes"], base["peak_resident_bytes"]) if base else None
            )
            v["coded_ratio"] = _ratio(v["coded_out_bytes"], v["coded_in_bytes"])
        rows.append(row)
        log(
            f"[models] {model.name} ({time.monotonic() - t0:.1f} s): "
            + ", ".join(f"{c} {v['rel_l2']:.2e}" for c, v in row["codecs"].items())
        )
    return rows


# -- the report -------------------------------------------------------------------------------


def _e(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return "inf" if math.isinf(x) else "nan"
    return "0" if x == 0 else f"{x:.2e}"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    if math.isinf(xs[hi]) or math.isinf(xs[lo]):
        return xs[hi]
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def markdown(res: dict[str, Any], notes: str = "") -> str:
    meta = res["meta"]
    codecs: list[str] = meta["codecs"]
    lossy = [c for c in codecs if c != "none"]
    L: list[str] = []
    w = L.append
    w(
        f"# Codec error: gradients with lossy saved activations, {meta['machine_tag']}, {meta['date']}"
    )
    w("")
    w(
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs (other work ran at the same time: "
        f"timings are indicative only), torch {meta['torch']}, transformers "
        f"{meta['transformers']}, Python {meta['python']}. Produced by `scripts/codec_error.py` "
        f"(this file and the JSON next to it are written by the script; numbers are its own):"
    )
    w("")
    w("```sh")
    w(meta["command"])
    w("```")
    w("")
    start, end = meta.get("code_sha256_start", {}), meta.get("code_sha256_end", {})
    if start:
        w(
            "Code measured (sha256 prefixes; the tree was being edited by other work, so these "
            "identify the version): " + ", ".join(f"`{f}` {h}" for f, h in start.items()) + "."
        )
        if end and end != start:
            changed = sorted(f for f in set(start) | set(end) if start.get(f) != end.get(f))
            w(
                "**These files changed while the script ran** (the numbers are from the code "
                "imported at the start, unless a module was imported later): "
                + ", ".join(f"`{f}`" for f in changed)
                + "."
            )
        w("")
    w(
        f"Total runtime {meta['seconds']:.0f} s (op corpus {res['ops']['seconds']:.0f} s). "
        "Codec settings are the defaults (`codec_group=256`, symmetric int8, round to nearest) "
        "and tier `keep` (the codec is the same on every tier: [codes through the tiers])."
    )
    w("")
    w(
        "Errors: `rel L2 = ||g_codec - g|| / ||g||`, `max = max|g_codec - g| / max|g|` over all "
        "the gradients of a case concatenated (elements where the reference is not finite left "
        "out; `inf`: the codec produced a NaN or infinity where the reference had none). The "
        "reference is the same computation without offloadd, checked to be bit-reproducible "
        "(a second plain run); `none` under offloadd must be exactly 0."
    )
    w("")

    # models
    w("## Models (random weights, one training step)")
    w("")
    w(
        "All parameter gradients of one forward + backward (loss from the model's own head). "
        "Training mode with every dropout probability 0, so that plain and coded runs are "
        "deterministic and comparable (dropout masks would differ otherwise); with dropout "
        "`scaled_dot_product_attention` is also left exact (allowlist.py). Default allow list, default "
        "`codec_min_bytes` (64 KiB). `saved` = `stats().saved_bytes` with the codec / without "
        "(tier keep; counts views each time and parameters saved by ops, and a coded storage "
        "saved twice once); `peak` = `peak_resident_bytes` ratio (activation memory held, "
        "parameters not counted); `coded out/in` = `coded_out_bytes / coded_in_bytes`; "
        "`worst param` = the parameter with the largest rel L2 of its own."
    )
    w("")
    for row in res["models"]:
        det = "" if row["deterministic"] else " **(reference NOT reproducible)**"
        tiny = row.get("negligible_grad_params", [])
        left = (
            "; left out of `worst param` as their exact gradient is ~0 (rms below 1e-4 of all): "
            + ", ".join(f"`{n}`" for n in tiny)
            if tiny
            else ""
        )
        w(f"- **{row['model']}**: {row['what']}; {row['parameters']:,} parameters{det}{left}.")
    w("")
    w(
        "| model | codec | rel L2 | max | worst param (rel L2) | coded tensors | coded out/in "
        "| saved | peak |"
    )
    w("|---|---|---|---|---|---|---|---|---|")
    for row in res["models"]:
        for c in codecs:
            v = row["codecs"][c]
            same = "" if v["loss_identical"] else " (loss differs!)"
            worst = f"`{v['worst_param']}` {_e(v['worst_param_rel_l2'])}" if v["rel_l2"] else "-"
            coded_ratio = _r(v["coded_ratio"]) if v["coded_tensors"] else "-"
            w(
                f"| {row['model']} | {c}{same} | {_e(v['rel_l2'])} | {_e(v['max_rel'])} | "
                f"{worst} | {v['coded_tensors']} | {coded_ratio} | {_r(v['saved_ratio'])} | "
                f"{_r(v['peak_ratio'])} |"
            )
    w("")

    # probes
    w("## Probes: allowed ops on inputs that are hard for per-group ranges")
    w("")
    w(
        "Random-weight models have well-scaled activations; trained ones do not (outlier "
        "channels, large offsets, peaky attention). Each probe: one allowed op, default allow "
        "list and `codec_min_bytes`, gradients of its inputs (and parameters) for a random "
        "cotangent; rel L2 (max) per codec; `coded`: tensors coded, per codec in the order of "
        "the columns. Shapes: "
        + ("(2, 32, 256)" if meta["quick"] else "(4, 128, 256)")
        + " for layer norm and linear (`nn.LayerNorm` and `nn.Linear`: their parameters are never "
        "coded), 4 heads for softmax and attention."
    )
    w("")
    w("| probe | coded | " + " | ".join(lossy) + " |")
    w("|---|---|" + "---|" * len(lossy))
    for p in res["probes"]:
        cells = [f"{_e(p['codecs'][c]['rel_l2'])} ({_e(p['codecs'][c]['max_rel'])})" for c in lossy]
        coded = "/".join(str(p["codecs"][c]["coded_tensors"]) for c in lossy)
        w(f"| {p['probe']} | {coded} | " + " | ".join(cells) + " |")
    w("")

    # op corpus
    ops = res["ops"]
    cases = expand_cases(ops)
    by = {(c["op"], c["codec"], c["mode"]): c for c in cases}
    names = sorted(set(ops.get("forced_codec_ops", {})) | {c["op"] for c in cases})
    w("## Op corpus (`op_db`)")
    w("")
    skips = ops["skipped_ops"]
    w(
        f"{ops['ops_considered']} OpInfos of `op_db` have autograd and a float32 backward on CPU; "
        f"{len(names)} had at least one usable sample, {len(skips)} were skipped (reasons in the "
        f"JSON: `skipped_ops`). At most {meta['max_samples']} float32 samples per op (the first "
        "ones, as PyTorch generates them from seed 0); each op's error is the worst of its "
        "samples. Cotangent: a fixed `randn` per output. Every mode uses `codec_min_bytes=1` (the "
        "corpus's tensors are tiny: with the default 64 KiB nothing would be coded)."
    )
    reasons: dict[str, int] = {}
    for why in skips.values():
        key = why.split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1
    if reasons:
        w("")
        w(
            "Skipped ops by reason: "
            + "; ".join(f"{k}: {n}" for k, n in sorted(reasons.items()))
            + "."
        )
    if ops["skipped_samples_by_reason"]:
        w(
            "Skipped samples (of ops otherwise counted or not) by reason: "
            + "; ".join(f"{k}: {n}" for k, n in sorted(ops["skipped_samples_by_reason"].items()))
            + "."
        )
    failed = [c for c in cases if c["failures"]]
    w("")
    if failed:
        w("**Runs that failed under the codec** (exception, or a forward output that changed):")
        w("")
        for c in failed:
            w(f"- `{c['op']}` {c['codec']} {c['mode']}: {'; '.join(sorted(set(c['failures'])))}")
    else:
        w("No run raised under a codec and no forward output changed.")
    w("")
    if "none" in codecs:
        nonzero = [n for n in names if (by.get((n, "none", "default")) or {}).get("rel_l2")]
        w(
            "Codec `none` under offloadd: "
            + (
                "error exactly 0 for every op."
                if not nonzero
                else f"**nonzero error for {', '.join(nonzero)}**."
            )
        )
        w("")

    # default mode
    w("### Default allow list: what users get")
    w("")
    coded_default = [
        n
        for n in names
        if any((by.get((n, c, "default")) or {}).get("coded_tensors", 0) for c in lossy)
    ]
    moved = [
        n
        for n in names
        if n not in coded_default
        and any((by.get((n, c, "default")) or {}).get("rel_l2", 0) for c in lossy)
    ]
    w(
        f"{len(coded_default)} of {len(names)} ops had a saved tensor coded; every other op's "
        + (
            "gradients were unchanged (error exactly 0)."
            if not moved
            else f"gradients were unchanged except **{', '.join(moved)}** (changed with nothing coded!)."
        )
        + " Per coded op: rel L2 (max), worst sample; `n` = tensors coded per sample run, int8 "
        "(a tensor is coded only where its codes and ranges are smaller than it, so int4 and "
        "int2 take a few more small ones); `not coded`: nothing of that op was coded with that "
        "codec."
    )
    w("")
    w(
        "`allowed called`: the allow list's functions among those the op's forward called at the "
        "outermost level, which is what the list is matched against (an op_db entry that is a "
        "Python function not dispatched as a torch function for plain tensors, such as "
        "`torch.masked.*` or `pca_lowrank`, exposes the functions it calls)."
    )
    w("")
    w("| op | allowed called | n | " + " | ".join(lossy) + " |")
    w("|---|---|---|" + "---|" * len(lossy))
    outer = ops.get("forced_codec_ops", {})
    for n in coded_default:
        first = by.get((n, lossy[0], "default")) or {}
        per = first.get("coded_tensors", 0) / max(first.get("samples", 1), 1)
        shown = ", ".join(f for f in outer.get(n, []) if f in DEFAULT_OPS)
        cells = []
        for c in lossy:
            v = by.get((n, c, "default"))
            cells.append(
                "not coded"
                if v is None or not v["coded_tensors"]
                else f"{_e(v['rel_l2'])} ({_e(v['max_rel'])})"
            )
        w(f"| `{n}` | {shown} | {per:.1f} | " + " | ".join(cells) + " |")
    w("")

    # forced mode
    w("### Forced: every floating saved tensor with an argument's shape coded")
    w("")
    w(
        "`codec_ops` = the torch functions the op's forward calls at the outermost level "
        "(recorded per op, normally just the op's own function; JSON: `forced_codec_ops`), so "
        "the op's saved inputs and outputs are coded whatever the allow list says. This is each "
        "op's sensitivity, not what users get. Distribution of rel L2 over the ops where at "
        "least one tensor was coded (`inf` counts as above every threshold):"
    )
    w("")
    modes = ["forced"] + (["forced-g16"] if any(c["mode"] == "forced-g16" for c in cases) else [])
    w("| codec | mode | ops coded | median | p90 | max | ≥ 1e-2 | ≥ 1e-1 | ≥ 1 | inf/NaN |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for c in lossy:
        for mode in modes:
            errs = [
                by[(n, c, mode)]["rel_l2"]
                for n in names
                if (n, c, mode) in by and by[(n, c, mode)]["coded_tensors"]
            ]
            if not errs:
                w(f"| {c} | {mode} | 0 | - | - | - | - | - | - | - |")
                continue
            w(
                f"| {c} | {mode} | {len(errs)} | {_e(_quantile(errs, 0.5))} | "
                f"{_e(_quantile(errs, 0.9))} | {_e(max(errs))} | {sum(e >= 1e-2 for e in errs)} | "
                f"{sum(e >= 1e-1 for e in errs)} | {sum(e >= 1 for e in errs)} | "
                f"{sum(math.isinf(e) or math.isnan(e) for e in errs)} |"
            )
    w("")
    if "forced-g16" in modes:
        w(
            f"`forced-g16`: the same with `codec_group={SMALL_GROUP}`. op_db's tensors are mostly "
            "smaller than a group of 256 values, and a tensor is coded only where its codes and "
            "ranges are smaller than it, so at the default group many ops code nothing; smaller "
            "groups code them, with tighter ranges (so smaller errors than the default group "
            "would give on the same values)."
        )
        w("")
    top = 15
    for mode in modes:
        for c in lossy:
            ranked = sorted(
                (
                    by[(n, c, mode)]
                    for n in names
                    if (n, c, mode) in by and by[(n, c, mode)]["coded_tensors"]
                ),
                key=lambda v: -v["rel_l2"] if not math.isnan(v["rel_l2"]) else -math.inf,
            )[:top]
            w(
                f"Worst {len(ranked)} ops, {c}, {mode}: "
                + ", ".join(
                    f"`{v['op']}` {_e(v['rel_l2'])}" + (" (allowed)" if _allowed(v["op"]) else "")
                    for v in ranked
                )
                + "."
            )
            w("")
    w(
        "The ops that allowlist.py leaves out on purpose, forced: rel L2 (max)"
        + (", then rel L2 of `forced-g16`" if "forced-g16" in modes else "")
        + ":"
    )
    w("")
    w("| op | " + " | ".join(lossy) + " |")
    w("|---|" + "---|" * len(lossy))
    for n in names:
        if n.split(".")[0] in DENIED or n in DENIED:
            cells = []
            for c in lossy:
                parts = []
                for mode in modes:
                    v = by.get((n, c, mode))
                    if v is None or not v["coded_tensors"]:
                        parts.append("not coded")
                    elif mode == "forced":
                        parts.append(f"{_e(v['rel_l2'])} ({_e(v['max_rel'])})")
                    else:
                        parts.append(_e(v["rel_l2"]))
                cells.append(" / ".join(parts))
            w(f"| `{n}` | " + " | ".join(cells) + " |")
    w("")
    if notes:
        w("## Conclusions")
        w("")
        w(notes.strip())
        w("")
    return "\n".join(L)


def _allowed(op: str) -> bool:
    """Whether an op_db name is one of the allow list's functions (``softmax.with_dtype``)."""
    return op.removeprefix("nn.functional.").split(".")[0] in DEFAULT_OPS


# -- main -------------------------------------------------------------------------------------


CODE = ("offloadd/codec/*.py", "offloadd/runtime/offloader.py", "offloadd/config/schema.py")


def code_hashes() -> dict[str, str]:
    """sha256 (first 12 hex digits) of the files whose code is measured, to tell versions apart
    (other work may change them while the script runs: start and end are both recorded)."""
    files = sorted(f for pattern in CODE for f in ROOT.glob(pattern))
    return {
        str(f.relative_to(ROOT)): hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in files
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks", help="output folder")
    p.add_argument(
        "--name",
        default=f"codec_error_cpu-{os.cpu_count()}core_{datetime.date.today().isoformat()}",
        help="file name without extension (default: %(default)s)",
    )
    p.add_argument(
        "--codecs",
        default=",".join(LOSSY_DEFAULT),
        help="comma-separated codecs (default: %(default)s)",
    )
    p.add_argument("--max-samples", type=int, default=3, help="float32 samples per op (default 3)")
    p.add_argument("--only", default="", help="comma-separated op_db names (default: all)")
    p.add_argument("--skip-ops", action="store_true", help="leave out the op corpus")
    p.add_argument(
        "--no-small-group",
        action="store_true",
        help=f"op corpus: leave out the mode forced-g16 (codec_group={SMALL_GROUP})",
    )
    p.add_argument("--skip-models", action="store_true", help="leave out the models")
    p.add_argument(
        "--notes",
        type=Path,
        default=None,
        help="markdown file whose text becomes the report's Conclusions section (kept in the JSON)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="render the markdown from this earlier JSON (and --notes) without running anything",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke mode: ops {', '.join(QUICK_OPS[:3])}… only, 1 sample, 1-layer short models",
    )
    args = p.parse_args(argv)
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    bad = [c for c in args.codecs if c not in CODECS]
    if bad:
        p.error(f"unknown codec(s) {', '.join(bad)}; known: {', '.join(CODECS)}")
    args.only = [o for o in args.only.split(",") if o]
    if args.quick:
        args.max_samples = 1
        args.only = args.only or list(QUICK_OPS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notes = args.notes.read_text() if args.notes else ""
    if args.from_json is not None:
        res = json.loads(args.from_json.read_text())
        if args.notes:  # kept in the JSON, so that rendering it again gives the same report
            res["notes"] = notes
            args.from_json.write_text(dump_json(res))
        path = args.out / f"{args.name}.md"
        path.write_text(markdown(res, res.get("notes", "")))
        log(f"wrote {path} from {args.from_json}")
        return 0
    start = time.monotonic()
    import transformers

    meta = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "machine_tag": f"cpu-{os.cpu_count()}core",
        "machine": f"{platform.machine()} {platform.system()}, no GPU used",
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "codecs": args.codecs,
        "max_samples": args.max_samples,
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "code_sha256_start": code_hashes(),
    }
    res: dict[str, Any] = {"meta": meta, "notes": notes}
    res["probes"] = probes(args.codecs, args.quick)
    res["models"] = [] if args.skip_models else model_errors(args.codecs, args.quick)
    if args.skip_ops:
        res["ops"] = {
            "ops_considered": 0,
            "cases": [],
            "skipped_ops": {},
            "skipped_samples_by_reason": {},
            "forced_codec_ops": {},
            "seconds": 0.0,
        }
    else:
        res["ops"] = op_corpus(args.codecs, args.max_samples, args.only, not args.no_small_group)
    meta["seconds"] = time.monotonic() - start
    meta["code_sha256_end"] = code_hashes()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(dump_json(res))
    (args.out / f"{args.name}.md").write_text(markdown(res, notes))
    log(f"wrote {args.out / args.name}.md and .json in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
