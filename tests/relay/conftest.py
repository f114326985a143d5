"""Fixtures of the relay's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from offloadd.config import Config
from tests.relay.cases import MakeRelayConfig, relay_config


@pytest.fixture
def make_relay_config(offload_options: dict[str, object]) -> MakeRelayConfig:
    """``make_relay_config(disk_dir, **overrides)``: :func:`~tests.relay.cases.relay_config` on
    this test's engine (and through the daemon when it runs on the ``backend`` fixture's), the
    overrides taking precedence."""

    def make(disk_dir: Path, **overrides: object) -> Config:
        return relay_config(disk_dir, **{**offload_options, **overrides})

    return make
