"""PyTorch's op and module corpora, bit-identical with and without offloadd.

The comparison rule and the harness are in tests/_support/corpus.py. The default run takes a fixed
subset of every entry (each op of op_db that supports backward, its in-place variant where it
has one, each module of module_db): its
first and its last sample under the primary configuration (ssd, dedup, float64), and its first
sample under one other (configuration, dtype) pair, the pairs dealt out to the entries in turn so
that every configuration and dtype runs on an evenly spread share of the corpora. The full sweep
(every sample, every configuration, every dtype) is the ``slow`` test below;
scripts/corpus_sweep.py runs the same sweep and records it in docs/corpus.md.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests._support import corpus, corpus_run
from tests._support.daemon_proc import DaemonProc
from tests.conftest import _disk_root

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = corpus.entries()


@dataclass(frozen=True)
class Case:
    """The first (or last) sample of an entry under one configuration and dtype (None: the entry
    supports none of ours)."""

    entry: corpus.Entry
    config: corpus.Config
    dtype: torch.dtype | None
    last: bool = False

    def __str__(self) -> str:
        dtype = corpus.dtype_name(self.dtype) if self.dtype is not None else "nodtype"
        return f"{self.entry.name}-{dtype}-{self.config}-{'slast' if self.last else 's0'}"


# Every (configuration, dtype) pair but the primary one, dealt out to the entries in turn.
OTHER_PAIRS = [
    (config, dtype)
    for dtype in corpus.DTYPES
    for config in corpus.CONFIGS
    if (config, dtype) != (corpus.PRIMARY, torch.float64)
]


def default_cases(entries: list[corpus.Entry]) -> list[Case]:
    """The fixed subset of the default run: three cases per entry (two if the entry's turn
    lands on a dtype it lacks and no other pair fits)."""
    cases = []
    for i, entry in enumerate(entries):
        dtypes = entry.dtypes()
        if not dtypes:
            cases.append(Case(entry, corpus.PRIMARY, None))
            continue
        primary = Case(entry, corpus.PRIMARY, dtypes[0])  # float64 where it is supported
        turn = OTHER_PAIRS[i % len(OTHER_PAIRS) :] + OTHER_PAIRS[: i % len(OTHER_PAIRS)]
        other = next((Case(entry, c, d) for c, d in turn if d in dtypes), primary)
        cases += [primary, Case(entry, corpus.PRIMARY, dtypes[0], last=True)]
        cases += [other] if other != primary else []
    return cases


DEFAULT_CASES = default_cases(ENTRIES)


@pytest.fixture(scope="module")
def pool(daemon: DaemonProc) -> Iterator[corpus.OffloaderPool]:
    """The Offloaders of every configuration, shared by the module's tests; afterwards no file,
    no daemon session may be left."""
    d = Path(tempfile.mkdtemp(prefix="offloadd-corpus-", dir=_disk_root()))
    offloaders = corpus.OffloaderPool(d, lambda: daemon.socket)
    yield offloaders
    offloaders.close()
    leftovers = list(d.iterdir())
    for p in leftovers:
        p.unlink()
    d.rmdir()
    assert not leftovers, f"files left behind: {leftovers}"
    gc.collect()
    assert not daemon.wait_idle()["sessions"], "daemon sessions left open"


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=str)
def test_corpus_sample(case: Case, pool: corpus.OffloaderPool) -> None:
    if case.dtype is None:
        pytest.skip(corpus.no_dtype_reason())
    samples = case.entry.samples(case.dtype, limit=None if case.last else 1)
    if not samples:
        pytest.skip("no sample inputs")
    if case.last and len(samples) == 1:
        pytest.skip("a single sample, which the s0 case checks")
    index = len(samples) - 1 if case.last else 0
    outcome = corpus.check(samples[index], pool, [case.config])[case.config]
    if outcome.status == "skipped":
        pytest.skip(outcome.reason)
    assert outcome.status == "passed", f"{case} (sample {index}): {outcome.reason}"


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_corpus_full(entry: corpus.Entry, pool: corpus.OffloaderPool) -> None:
    """Every sample of ``entry`` in every dtype, under every configuration."""
    records = corpus.sweep_entry(entry, pool)
    failed = [
        f"{r.dtype} {r.config} sample {r.sample}: {r.reason}"
        for r in records
        if r.status == "failed"
    ]
    assert not failed, f"{entry.name}: {len(failed)} failing cases:\n" + "\n".join(failed)
    if all(r.status == "skipped" for r in records):
        pytest.skip("; ".join(sorted({r.reason for r in records})))


# -- the harness itself -------------------------------------------------------------------------


def test_default_run_covers_every_entry_configuration_and_dtype() -> None:
    assert {c.entry for c in DEFAULT_CASES} == set(ENTRIES)
    assert {c.config for c in DEFAULT_CASES} == set(corpus.CONFIGS)
    assert {c.dtype for c in DEFAULT_CASES} >= set(corpus.DTYPES)
    assert len({str(c) for c in DEFAULT_CASES}) == len(DEFAULT_CASES)  # ids are unique
    names = {e.name for e in ENTRIES}
    assert {"nn.functional.rrelu", "nn.Linear", "nn.LazyConv2d", "sin"} <= names


def test_difference_is_bitwise_and_nan_aware() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    other_nan = nan.clone()
    other_nan.view(torch.int64)[0] ^= 1  # another NaN payload
    assert torch.isnan(other_nan[0])
    assert corpus_run.difference(nan, other_nan) is None
    assert corpus_run.difference(nan, torch.tensor([1.0, float("nan")])) is not None
    assert corpus_run.difference(torch.tensor([0.0]), torch.tensor([-0.0])) is not None
    assert corpus_run.difference(torch.ones(2), torch.ones(2, dtype=torch.float64)) is not None
    assert corpus_run.difference(torch.ones(2), torch.ones(1, 2)) is not None
    z = torch.tensor([1 + 2j, complex("nan")])
    assert corpus_run.difference(z, z.clone()) is None
    # a conj view, same values
    assert corpus_run.difference(z, z.conj().resolve_conj().conj()) is None
    bf = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert "1 of 2 elements differ, first at [1]" in str(
        corpus_run.difference(bf, bf * torch.tensor([1, 3]))
    )
    assert corpus_run.difference(torch.arange(3), torch.arange(3)) is None
    assert corpus_run.difference(torch.arange(3), torch.arange(1, 4)) is not None


def _entry(name: str) -> corpus.Entry:
    return next(e for e in ENTRIES if e.name == name)


def test_harness_sees_a_changed_saved_tensor() -> None:
    """A saved tensor that comes back one ulp off is a failure the comparison reports."""
    sample = _entry("sin").samples(torch.float64, limit=1)[0]
    ref = sample.run(None)
    nudged = torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: torch.nextafter(t, t.new_tensor(float("inf")))
    )
    with nudged:
        got = sample.run(None)
    assert corpus_run.result_difference(ref, sample.run(None)) is None
    assert str(corpus_run.result_difference(ref, got)).startswith("grad of input 0:")


def test_harness_offloads_the_inputs(pool: corpus.OffloaderPool) -> None:
    """The sample's inputs reach offloadd as activations (not kept like parameters), and come
    back from disk."""
    off = pool.get(corpus.PRIMARY)
    before = off.stats()
    (sample,) = _entry("nn.functional.linear").samples(torch.float64, limit=1)
    assert corpus.check(sample, pool, [corpus.PRIMARY]) == {
        corpus.PRIMARY: corpus.Outcome("passed")
    }
    after = off.stats()
    assert after.saved_tensors > before.saved_tensors
    assert after.offloaded_bytes > before.offloaded_bytes
    assert after.bytes_read > before.bytes_read


def test_sweep_script_on_a_few_entries(tmp_path: Path) -> None:
    out = tmp_path / "corpus.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "corpus_sweep.py"),
            "--only",
            "sin,nn.functional.normalize,normal.number_mean,nn.Bilinear",
            "--max-samples",
            "2",
            "--dtypes",
            "float64,bfloat16",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.with_suffix(".json").read_text())
    text = out.read_text()
    assert doc["totals"]["failed"] == 0 and doc["totals"]["passed"] > 0
    assert {c["config"] for c in doc["summary"]} == {str(c) for c in corpus.CONFIGS}
    assert any(r["reason"] == "no output requires grad" for r in doc["skipped"])
    assert "scripts/corpus_sweep.py" in text and "no output requires grad" in text
    assert "4/4" in proc.stderr  # the progress line
