"""The front door: one ``Offloader`` class, its default config (Note [one default config] in
offloadd/offloader.py), and the narrow view a budget's planner gets of the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from offloadd import Config, Offloader
from offloadd.runtime.accounting import Ledger
from offloadd.runtime.stages import PlannerView
from offloadd.runtime.thread_state import ThreadState

PACKAGE = Path(__file__).resolve().parent.parent / "offloadd"


def test_one_class_named_offloader() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "Offloader"
    ]
    assert found == ["offloader.py:" + found[0].split(":")[1]], found
    assert Offloader.__mro__ == (Offloader, object)


def test_offloader_starts_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OFFLOADD_MIN_BYTES", "12345")
    monkeypatch.setenv("OFFLOADD_SSD_DIRS", str(tmp_path))
    off = Offloader(tier="keep")  # keywords over the environment
    try:
        assert off.config.min_bytes == 12345
        assert list(off.config.ssd_dirs) == [str(tmp_path)]
        assert off.config.tier == "keep"
    finally:
        off.close()
    given = Offloader(Config(tier="keep"))  # a Config given is taken as it is
    try:
        assert given.config.min_bytes == Config().min_bytes
    finally:
        given.close()


def test_offloader_refuses_an_unknown_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFLOADD_MIN_BYTE", "4")
    with pytest.raises(ValueError, match="OFFLOADD_MIN_BYTE='4'"):
        Offloader(tier="keep")


def test_planner_view_marks_this_thread_and_windows_the_ledger() -> None:
    ledger, tls = Ledger(0), ThreadState()
    view = PlannerView(ledger, tls)
    assert not view.in_scope()
    tls.stack = [object()]
    assert view.in_scope()
    view.set_keep(True)
    view.set_tag(3)
    assert (tls.keep, tls.tag) == (True, 3)
    ledger.stats.resident_bytes, ledger.stats.buffer_bytes, ledger.kept_now = 10, 5, 7
    ledger.window_peak = ledger.kept_peak = 99
    view.open_window()
    assert view.window() == (15, 7)
    assert view.buffer_bytes() == 5


def test_held_elsewhere_is_declared_weakly() -> None:
    """Relay declares what a model holds outside offloadd's counts; the planner's view reads
    it; neither the model nor the declaring object is kept alive by the registry."""
    import gc

    from torch import nn

    from offloadd.runtime.stages import HeldElsewhere

    class Holder:
        def held(self) -> int:
            return 42

    reg, model, holder = HeldElsewhere(), nn.Linear(2, 2), Holder()
    assert reg.of(model) == 0 and reg.of(None) == 0
    reg.declare(model, holder.held)
    assert reg.of(model) == 42
    del holder
    gc.collect()
    assert reg.of(model) == 0  # the declaring object went: nothing held
    holder = Holder()
    reg.declare(model, holder.held)
    reg.forget(model)
    assert reg.of(model) == 0
    reg.declare(model, holder.held)
    del model
    gc.collect()
    assert not list(reg._by_model.keys())  # the model went: its entry too
