from __future__ import annotations

from pathlib import Path

import pytest

from offloadd import Config, Offloader
from offloadd.config import parse_size

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_work_and_match_default_toml() -> None:
    assert Config.from_toml(ROOT / "configs" / "default.toml") == Config()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1 << 20),
        ("4MiB", 4 << 20),
        ("256k", 256 << 10),
        ("1G", 1 << 30),
        ("2MB", 2_000_000),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size("min_bytes", text) == expected


def test_env_overrides() -> None:
    cfg = Config.from_env(
        {
            "OFFLOADD_TIER": "keep",
            "OFFLOADD_MIN_BYTES": "64k",
            "OFFLOADD_SSD_DIRS": "/a,/b",
            "OFFLOADD_DEDUP": "false",
            "OFFLOADD_IO_THREADS": "2",
            "OFFLOADD": "1",
            "PATH": "/bin",
        }
    )
    assert (cfg.tier, cfg.min_bytes, cfg.ssd_dirs, cfg.dedup, cfg.io_threads) == (
        "keep",
        64 << 10,
        ("/a", "/b"),
        False,
        2,
    )


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("OFFLOADD_TIER", "disk"),
        ("OFFLOADD_MIN_BYTES", "lots"),
        ("OFFLOADD_DEDUP", "maybe"),
        ("OFFLOADD_IO_THREADS", "0"),
        ("OFFLOADD_CHUNK_BYTES", "1000"),
        ("OFFLOADD_DIRECT_IO", "sometimes"),
    ],
)
def test_env_bad_value_names_key_and_value(var: str, value: str) -> None:
    with pytest.raises(ValueError) as e:
        Config.from_env({var: value})
    msg = str(e.value)
    key = var.removeprefix("OFFLOADD_").lower()
    assert (var in msg or key in msg) and (value in msg)


def test_env_unknown_variable_is_an_error() -> None:
    with pytest.raises(ValueError, match="OFFLOADD_MIN_BYTE="):
        Config.from_env({"OFFLOADD_MIN_BYTE": "1"})


def test_toml_unknown_key_and_bad_file(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('tier = "ssd"\nmin_byte = 3\n')
    with pytest.raises(ValueError, match=r"c\.toml.*min_byte"):
        Config.from_toml(p)
    p.write_text("tier = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        Config.from_toml(p)
    with pytest.raises(ValueError, match="does not exist"):
        Config.from_toml(tmp_path / "missing.toml")
    p.write_text('[offload]\ntier = "keep"\nstaging_bytes = "8MiB"\n')
    assert Config.from_toml(p).staging_bytes == 8 << 20


def test_kwargs_validate() -> None:
    with pytest.raises(ValueError, match="tier"):
        Config(tier="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staging_bytes"):
        Config(staging_bytes=4096, chunk_bytes=8192)
    with pytest.raises(ValueError, match="min_bytes"):
        Offloader(tier="keep", min_bytes=-1)


def test_missing_or_unwritable_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Offloader(ssd_dirs=[str(tmp_path / "nope")])
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        Offloader(ssd_dirs=[str(f)])


def test_default_dir_is_on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from offloadd.io.files import default_offload_dir, filesystem_type

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    d = default_offload_dir()
    assert filesystem_type(d) not in ("tmpfs", "ramfs")
    off = Offloader()
    off.close()
