"""Fixtures of the runtime's tests."""

from __future__ import annotations

import pytest

from offloadd.runtime import dedup, held


@pytest.fixture(params=["native", "python"])
def tally_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The saved-tensor hooks of the C library (``native``) or their Python twin (see [the
    tally] in offloadd/runtime/held.py)."""
    if request.param == "native":
        if not held.NATIVE:
            pytest.fail("offloadd.runtime._held is not built (it must be wherever CI runs)")
    else:
        monkeypatch.setattr(held, "NATIVE", False)
        monkeypatch.setattr(held, "Tally", held._PyTally)
        monkeypatch.setattr(held, "Held", held._PyHeld)
    return str(request.param)


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps in which the storage index walked its models (Note [parameters learned])."""
    steps: list[int] = []
    learn = dedup.StorageIndex._learn

    def counted(self: dedup.StorageIndex) -> None:
        steps.append(self.step)
        learn(self)

    monkeypatch.setattr(dedup.StorageIndex, "_learn", counted)
    return steps
