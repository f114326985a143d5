"""The seams grid (docs/compose.md#the-seams-grid): every pair of offloadd's features and the
users' tools, each cell bit-identical to the same run without offloadd, with each feature having
done its work, or refused with an error that names both sides. Never a crash, never a silent
difference. The cells are ``tests/_support/seams/cells.py``'s; the default run takes its
``SAMPLE``, ``-m slow`` the rest.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.seams import launch
from tests._support.seams.arm import ArmSpec, Refused, run
from tests._support.seams.cells import (
    CELLS,
    FEATURES,
    IDLE,
    NOT_CELLS,
    SAMPLE,
    TOOLS,
    Cell,
    breaks,
    markdown,
    refused,
)

ENGINE_PARAMS = ("default",)  # composition, not I/O: the engine users get
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

Traces = list[dict[str, Any]]
# The references, per tool and where they ran, shared by a worker's cells.
_REFERENCES: dict[tuple[str, str], Traces] = {}
REL_ERROR = 0.05  # the codec's bound: int8's rel L2 error is below 1e-2 (docs/codec.md's page)


def _param(cell: Cell) -> Any:
    marks = [] if cell.id in SAMPLE else [pytest.mark.slow]
    if cell.cuda:
        marks.append(pytest.mark.cuda)
    return pytest.param(cell, id=cell.id, marks=marks)


def _reference_spec(cell: Cell, disk_dir: Path) -> ArmSpec:
    return ArmSpec(tools=cell.tools, dirs=str(disk_dir), breaks=breaks(cell) is not None)


def _reference(cell: Cell, disk_dir: Path, tmp: Path) -> Traces:
    spec = _reference_spec(cell, disk_dir)
    key = (cell.tool, cell.process, str(spec.breaks))
    if key not in _REFERENCES:
        if not cell.process:
            _REFERENCES[key] = [run(spec)]
        else:
            ranks = 2 if cell.process == "ranks" else 0
            _REFERENCES[key] = launch.arm(spec, cache=launch.fresh_cache(tmp), ranks=ranks)
    return _REFERENCES[key]


def _arms(cell: Cell, disk_dir: Path, tmp: Path, socket: str) -> list[tuple[Traces, Traces, bool]]:
    """What to compare: (reference, other, whether the other is offloadd's), traces per rank."""
    env_arm = "env" in cell.features
    explicit = tuple(f for f in cell.features if f != "env" and not env_arm)
    spec = ArmSpec(features=explicit, tools=cell.tools, dirs=str(disk_dir), socket=socket)
    ref_spec = _reference_spec(cell, disk_dir)
    if not cell.process:
        try:
            got = [run(spec)]
        except Refused as e:
            got = [{"refused": str(e)}]
        return [(_reference(cell, disk_dir, tmp), got, True)]
    ranks = 2 if cell.process == "ranks" else 0
    report = str(tmp / ("report-{rank}.json" if ranks else "report.json"))
    env = launch.env_of(cell, spec, report) if env_arm else None

    def offloadd_arm(cache: Path) -> Traces:
        return launch.arm(spec, cache=cache, ranks=ranks, env=env, report=report)

    if cell.process != "warm":
        return [(_reference(cell, disk_dir, tmp), offloadd_arm(launch.fresh_cache(tmp)), True)]
    # warm: the cache filled by a run without offloadd, then by offloadd's; a run without
    # offloadd after both must not take offloadd's graphs either
    cache = launch.fresh_cache(tmp)
    plain = launch.arm(ref_spec, cache=cache)
    after_plain = offloadd_arm(cache)
    after_offloadd = offloadd_arm(cache)
    plain_again = launch.arm(ref_spec, cache=cache)
    return [(plain, after_plain, True), (plain, after_offloadd, True), (plain, plain_again, False)]


def _flatten(trace: dict[str, Any], path: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    items = trace.items() if isinstance(trace, dict) else enumerate(trace)
    for k, v in items:
        if k == "did":
            continue
        where = f"{path}.{k}" if path else str(k)
        out.extend(_flatten(v, where) if isinstance(v, dict | list) else [(where, v)])
    return out


def _compare(ref: dict[str, Any], got: dict[str, Any], *, exact: bool) -> None:
    a, b = _flatten(ref), _flatten(got)
    assert [k for k, _ in a] == [k for k, _ in b], "the runs recorded different things"
    for (where, x), (_, y) in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, where
        if exact or where.startswith("rng"):
            assert torch.equal(x, y), (
                f"{where} differs (max {(x.double() - y.double()).abs().max()})"
            )
            continue
        assert torch.isfinite(y).all() or not torch.isfinite(x).all(), f"{where} not finite"
        if where.startswith("grads.") and not where.startswith("grads.0."):
            # taken at weights the earlier steps' coded gradients moved: how training diverges
            # (docs/codec.md's convergence curves), not the codec's error, which the first
            # step's gradients measure at the same weights
            continue
        err = (x.double() - y.double()).norm() / max(x.double().norm().item(), 1e-30)
        assert err <= REL_ERROR, f"{where}: relative error {err:.3g} over {REL_ERROR}"


def _said(trace: dict[str, Any], words: tuple[str, ...]) -> None:
    said = " | ".join(trace["did"].get("warnings", ()))
    assert all(w in said for w in words), f"a warning with {words} expected: {said!r}"


def _did(cell: Cell, trace: dict[str, Any]) -> None:
    if (words := breaks(cell)) is not None and "env" not in cell.features:
        _said(trace, words)
    if (words := IDLE.get(cell.id)) is not None:
        _said(trace, words)
        return
    for name in cell.features:
        if name == "env":
            continue
        metric = cell.feature(name).did
        assert trace["did"].get(metric, 0) > 0, f"{name} did nothing: {metric} in {trace['did']}"
    if "env" in cell.features:
        assert trace["did"].get("saved_tensors", 0) > 0, f"OFFLOADD=1 saw nothing: {trace['did']}"


@pytest.mark.parametrize("cell", [_param(c) for c in CELLS])
def test_cell(cell: Cell, disk_dir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    socket = request.getfixturevalue("daemon").socket if "daemon" in cell.features else ""
    words = refused(cell)
    for refs, gots, offloaded in _arms(cell, disk_dir, tmp_path, socket):
        for ref, got in zip(refs, gots, strict=True):
            if "refused" in got:
                assert words is not None, f"refused, not by cells.refused: {got['refused']}"
                missing = [w for w in words if w not in got["refused"]]
                assert not missing, f"the refusal lacks {missing}: {got['refused']}"
                continue
            assert words is None or not offloaded, f"not refused, yet cells.refused: {cell.id}"
            _compare(ref, got, exact=cell.exact or not offloaded)
            if offloaded:
                _did(cell, got)


def test_docs_show_the_grid() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "compose.md").read_text()
    assert markdown() in text, "docs/compose.md's grid is not cells.markdown(): paste it again"


def test_grid_covers_every_pair() -> None:
    ids = {c.id for c in CELLS}
    assert len(ids) == len(CELLS) and ids >= SAMPLE and ids >= set(IDLE)
    pairs = {(c.features[0], c.tool) for c in CELLS if len(c.features) == 1}
    assert pairs == {(f.name, t.name) for f in FEATURES for t in TOOLS}
    for a, b in itertools.combinations(FEATURES, 2):
        paired = any(set(c.features) == {a.name, b.name} for c in CELLS)
        assert (
            paired
            or a.axis == b.axis
            or frozenset({a.name, b.name}) in NOT_CELLS
            or ("env" in (a.name, b.name) and None in (a.env, b.env))
        ), (a.name, b.name)
