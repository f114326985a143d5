"""Keys renamed since the first release are still read, for one release, with a warning.

``daemon_socket`` (the first release's key of the daemon's socket) became ``daemon.socket`` when
the daemon's settings became a section. Each entry point reads the old name: keyword arguments
(``Offloader``, ``Config``, ``Config.replace``), a mapping and a TOML file (top level and
``[offload]``); its variable kept its spelling. Each warns (DeprecationWarning) naming the old key, the new
one and where the value came from; old and new given in one place with different values is a
ValueError naming both.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from offloadd import Config, DaemonConfig, Offloader

ROOT = Path(__file__).resolve().parent.parent
SOCK = "/run/old.sock"


@contextmanager
def one_deprecation(*named: str) -> Iterator[None]:
    """Exactly one DeprecationWarning, naming each of ``named``, pointing at this file."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        yield
    found = [w for w in got if issubclass(w.category, DeprecationWarning)]
    assert len(found) == 1, [str(w.message) for w in got]
    message = str(found[0].message)
    for text in named:
        assert text in message, message
    assert found[0].filename == __file__, found[0].filename  # the caller's line, not offloadd's


def test_offloader_keyword() -> None:
    with one_deprecation("daemon_socket", "daemon.socket", "keyword argument"):
        off = Offloader(tier="keep", daemon_socket=SOCK)
    try:
        assert off.config.daemon.socket == SOCK
    finally:
        off.close()
    base = Config(tier="keep", daemon=DaemonConfig(quota_bytes=4096))
    with one_deprecation("daemon_socket", "daemon.socket"):
        off = Offloader(base, daemon_socket=SOCK)
    try:
        assert (off.config.daemon.socket, off.config.daemon.quota_bytes) == (SOCK, 4096)
    finally:
        off.close()


def test_config_and_replace_keywords() -> None:
    with one_deprecation("daemon_socket", "daemon.socket", "keyword argument"):
        cfg = Config(daemon_socket=SOCK, daemon=DaemonConfig(io_threads=2))
    assert (cfg.daemon.socket, cfg.daemon.io_threads) == (SOCK, 2)
    assert cfg == Config(daemon=DaemonConfig(socket=SOCK, io_threads=2))
    with one_deprecation("daemon_socket", "daemon.socket", "keyword argument"):
        again = Config(min_bytes=1, daemon=DaemonConfig(quota_bytes=4096)).replace(
            daemon_socket=SOCK
        )
    assert (again.min_bytes, again.daemon.quota_bytes, again.daemon.socket) == (1, 4096, SOCK)
    with one_deprecation("daemon_socket"):  # a mapping of the section's keys is merged
        both = Config().replace(daemon_socket=SOCK, daemon={"io_threads": 3})
    assert (both.daemon.socket, both.daemon.io_threads) == (SOCK, 3)


def test_toml_file_and_mapping(tmp_path: Path) -> None:
    p = tmp_path / "old.toml"
    for text in (
        f'tier = "keep"\ndaemon_socket = "{SOCK}"\n',
        f'[offload]\ntier = "keep"\ndaemon_socket = "{SOCK}"\n',
        f'[offload]\ndaemon_socket = "{SOCK}"\n[daemon]\nquota_bytes = "1MiB"\n',
    ):
        p.write_text(text)
        with one_deprecation("daemon_socket", "daemon.socket", str(p)):
            cfg = Config.from_toml(p)
        assert cfg.daemon.socket == SOCK
    assert cfg.daemon.quota_bytes == 1 << 20  # merged with the section's own keys
    with one_deprecation("daemon_socket", "daemon.socket"):
        assert Config.from_mapping({"daemon_socket": SOCK}).daemon.socket == SOCK
    # places layer as usual: the variable over the file, no conflict between them
    p.write_text(f'daemon_socket = "{SOCK}"\n')
    env = {"OFFLOADD_CONFIG": str(p), "OFFLOADD_DAEMON_SOCKET": "/run/env.sock"}
    with one_deprecation("daemon_socket", str(p)):
        assert Config.load(environ=env).daemon.socket == "/run/env.sock"


def test_environment_variable_kept_its_name() -> None:
    """``daemon_socket``'s variable was OFFLOADD_DAEMON_SOCKET, which is also daemon.socket's:
    it is not deprecated, and reads as it always did."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = Config.from_env({"OFFLOADD_DAEMON_SOCKET": SOCK})
    assert cfg.daemon.socket == SOCK


@pytest.mark.parametrize(
    "give",
    [
        lambda: Offloader(tier="keep", daemon_socket=SOCK, daemon={"socket": "/run/new.sock"}),
        lambda: Config(daemon_socket=SOCK, daemon=DaemonConfig(socket="/run/new.sock")),
        lambda: Config().replace(daemon_socket=SOCK, daemon={"socket": "/run/new.sock"}),
        lambda: Config.from_mapping({"daemon_socket": SOCK, "daemon": {"socket": "/run/new.sock"}}),
    ],
    ids=["Offloader", "Config", "replace", "from_mapping"],
)
def test_old_and_new_key_with_different_values(give: object) -> None:
    with pytest.raises(ValueError, match=r"daemon_socket.*daemon\.socket.*'/run/old\.sock'"):
        give()  # type: ignore[operator]


def test_old_and_new_key_in_one_file(tmp_path: Path) -> None:
    p = tmp_path / "both.toml"
    p.write_text(f'[offload]\ndaemon_socket = "{SOCK}"\n[daemon]\nsocket = "/run/new.sock"\n')
    with pytest.raises(ValueError) as e:
        Config.from_toml(p)
    assert "daemon_socket" in str(e.value) and "daemon.socket" in str(e.value)
    assert "/run/new.sock" in str(e.value) and str(p) in str(e.value)
    # the same value twice is no conflict (one warning for the old name)
    p.write_text(f'[offload]\ndaemon_socket = "{SOCK}"\n[daemon]\nsocket = "{SOCK}"\n')
    with one_deprecation("daemon_socket"):
        assert Config.from_toml(p).daemon.socket == SOCK


def test_deprecated_names_are_documented() -> None:
    from offloadd.config.renamed import REMOVED_IN, RENAMED

    for doc in (ROOT / "docs" / "tiers-and-config.md", ROOT / "docs" / "usage-envvar.md"):
        text = doc.read_text()
        assert "Deprecated names" in text, doc
        for old, new in RENAMED.items():
            row = next((line for line in text.splitlines() if f"`{old}`" in line), "")
            assert f"`{new}`" in row and REMOVED_IN in row, (doc, old, row)


def test_first_release_class_name() -> None:
    """``offloadd.OffloadConfig`` (the first release's name of Config) still imports, warning."""
    import offloadd
    import offloadd.config

    for module in (offloadd, offloadd.config):
        with pytest.warns(DeprecationWarning, match=r"OffloadConfig is deprecated: it is .*Config"):
            cls = module.OffloadConfig
        assert cls is Config
        with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
            _ = module.NoSuchName
