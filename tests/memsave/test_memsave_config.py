"""The ``memsave`` configuration key and its application under ``OFFLOADD=1``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offloadd import Config
from offloadd.integrations.autoload import EnvSettings
from tests._support.envrun import CLIENTS, PYTHON, clean_env, last_json, offload_env, run

ENGINE_PARAMS = ("python",)  # the subprocess picks its own engine; one run is enough
CLIENT = str(CLIENTS / "memsave_train.py")


def test_memsave_key() -> None:
    assert Config().memsave is False
    assert Config(memsave=True).memsave is True
    assert Config.from_mapping({"memsave": "yes"}).memsave is True
    assert Config.from_env({"OFFLOADD_MEMSAVE": "1"}).memsave is True
    assert Config.from_env({"OFFLOADD_MEMSAVE": "off"}, base=Config(memsave=True)).memsave is False
    assert Config().replace(memsave=True).as_dict()["memsave"] is True


def test_memsave_key_errors_name_it() -> None:
    with pytest.raises(ValueError, match="memsave"):
        Config.from_env({"OFFLOADD_MEMSAVE": "maybe"})
    with pytest.raises(ValueError, match="memsave"):
        Config(memsave="sometimes")  # type: ignore[arg-type]


def test_memsave_from_toml(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[offload]\nmemsave = true\n")
    assert Config.from_toml(p).memsave is True


def test_env_settings_read_memsave(disk_dir: Path) -> None:
    env = {"OFFLOADD": "1", "OFFLOADD_SSD_DIRS": str(disk_dir), "OFFLOADD_MEMSAVE": "true"}
    settings = EnvSettings.from_env(env)
    assert settings.enabled and settings.config.memsave


def test_env_var_memsave_is_identical(disk_dir: Path, tmp_path: Path) -> None:
    base = last_json(run([PYTHON, CLIENT, "2"], clean_env()).stdout)
    assert base["classes"][0] == "Conv2d"
    report = tmp_path / "report.json"  # (memsave is off by default: tests/config/)
    env = offload_env(disk_dir, report, OFFLOADD_MEMSAVE="1")
    got = last_json(run([PYTHON, CLIENT, "2"], env).stdout)
    assert (got["losses"], got["weights"]) == (base["losses"], base["weights"])
    assert got["classes"][:7] == [
        "MemsaveConv2d",
        "MemsaveBatchNorm2d",
        "MemsaveReLU",
        "MemsaveMaxPool2d",
        "MemsaveConv2d",
        "MemsaveBatchNorm2d",
        "MemsaveReLU",
    ]
    assert got["classes"][8:] == ["MemsaveDropout", "Linear"]
    assert json.loads(report.read_text())["config"]["memsave"] is True
