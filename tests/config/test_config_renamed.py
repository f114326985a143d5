"""Keys renamed since the first release are still read, for one release, with a warning.

``daemon_socket`` (the first release's key of the daemon's socket) became ``daemon.socket`` when
the daemon's settings became a section; the codec's flat keys (``codec``, ``codec_group``, ...)
became the ``codec`` section (``codec.name``, ``codec.group``, ...). Each entry point reads the
old names: keyword arguments (``Offloader``, ``Config``, ``Config.replace``), a mapping, a TOML
file (top level and ``[offload]``) and the environment (``OFFLOADD_CODEC``, the one old variable
spelled otherwise than its new key's). Each warns (DeprecationWarning) naming the old key, the
new one and where the value came from; old and new given in one place with different values is
a ValueError naming both.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from offloadd import CodecConfig, Config, DaemonConfig, Offloader

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
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
            row = next((line for line in text.splitlines() if line.startswith(f"| `{old}` |")), "")
            assert f"`{new}`" in row and REMOVED_IN in row, (doc, old, row)


# -- the codec's flat keys, now the codec section ----------------------------------------------


@contextmanager
def deprecations(*pairs: tuple[str, str]) -> Iterator[None]:
    """One DeprecationWarning per (old, new) pair, each naming both, all pointing at this file."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        yield
    found = [w for w in got if issubclass(w.category, DeprecationWarning)]
    assert len(found) == len(pairs), [str(w.message) for w in got]
    for (old, new), w in zip(pairs, found, strict=True):
        message = str(w.message)
        assert message.startswith(f"{old} (from ") and f"it is {new} now" in message, message
        assert w.filename == __file__, w.filename


OLD_CODEC = {"codec": "int4", "codec_group": 64, "codec_stochastic": True, "codec_seed": 3}
NEW_CODEC = CodecConfig(name="int4", group=64, stochastic=True, seed=3)
OLD_PAIRS = [(old, f"codec.{old.removeprefix('codec_') if old != 'codec' else 'name'}")
             for old in OLD_CODEC]  # fmt: skip


def test_codec_flat_keywords() -> None:
    with deprecations(*OLD_PAIRS):
        cfg = Config(**OLD_CODEC)  # type: ignore[arg-type]
    assert cfg.codec == NEW_CODEC and cfg == Config(codec=NEW_CODEC)
    with deprecations(*OLD_PAIRS):
        off = Offloader(tier="keep", **OLD_CODEC)
    try:
        assert off.config.codec == NEW_CODEC
    finally:
        off.close()
    with deprecations(("codec_min_bytes", "codec.min_bytes")):  # merged into the section
        again = Config(codec=NEW_CODEC).replace(codec_min_bytes="1KiB")
    assert again.codec == CodecConfig(**{**NEW_CODEC.as_dict(), "min_bytes": 1024})
    with deprecations(("codec", "codec.name")):
        assert Config().replace(codec="int8").codec == CodecConfig(name="int8")
    with deprecations(("codec_ops", "codec.ops")):
        both = Config(codec_ops=["linear"], codec=CodecConfig(name="int8"))  # type: ignore[call-arg]
    assert both.codec == CodecConfig(name="int8", ops=("linear",))


def test_codec_flat_keys_in_a_file_and_a_mapping(tmp_path: Path) -> None:
    p = tmp_path / "old.toml"
    flat = 'codec = "int4"\ncodec_group = 64\ncodec_stochastic = true\ncodec_seed = 3\n'
    for text in (flat, f"[offload]\n{flat}"):
        p.write_text(text)
        with deprecations(*OLD_PAIRS):
            assert Config.from_toml(p).codec == NEW_CODEC
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        Config.from_toml(p)
    assert str(p) in str(got[0].message) and "name = ... in the [codec] table" in str(
        got[0].message
    )
    p.write_text('codec_group = 64\n[codec]\nname = "int4"\n')  # old keys beside the table
    with deprecations(("codec_group", "codec.group")):
        assert Config.from_toml(p).codec == CodecConfig(name="int4", group=64)
    with deprecations(*OLD_PAIRS):
        assert Config.from_mapping(OLD_CODEC).codec == NEW_CODEC


def test_codec_variable() -> None:
    """OFFLOADD_CODEC (the old key codec's variable) is now OFFLOADD_CODEC_NAME; the other
    variables, OFFLOADD_CODEC_GROUP and so on, were spelled as the new keys' are already."""
    env = {"OFFLOADD_CODEC": "int4", "OFFLOADD_CODEC_GROUP": "64"}
    with deprecations(("OFFLOADD_CODEC", "codec.name")):
        cfg = Config.from_env(env)
    assert cfg.codec == CodecConfig(name="int4", group=64)
    with deprecations(("OFFLOADD_CODEC", "codec.name")):  # the same value twice: no conflict
        Config.from_env({"OFFLOADD_CODEC": "int8", "OFFLOADD_CODEC_NAME": "int8"})
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match=r"OFFLOADD_CODEC, OFFLOADD_CODEC_NAME: both given"),
    ):
        Config.from_env({"OFFLOADD_CODEC": "int8", "OFFLOADD_CODEC_NAME": "int4"})
    bad = r"^codec\.name: 'int3' is not one of .*OFFLOADD_CODEC\)"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=bad):
        Config.from_env({"OFFLOADD_CODEC": "int3"})


@pytest.mark.parametrize(
    "give",
    [
        lambda: Offloader(tier="keep", codec_group=64, codec={"group": 32}),
        lambda: Config(codec_group=64, codec=CodecConfig(group=32)),  # type: ignore[call-arg]
        lambda: Config().replace(codec_group=64, codec={"group": 32}),
        lambda: Config.from_mapping({"codec_group": 64, "codec": {"group": 32}}),
    ],
    ids=["Offloader", "Config", "replace", "from_mapping"],
)
def test_old_and_new_codec_key_with_different_values(give: object) -> None:
    with pytest.raises(ValueError, match=r"^codec_group, codec\.group: both given, as 64 and 32"):
        give()  # type: ignore[operator]


def test_old_codec_key_errors_name_the_new_key() -> None:
    with (
        pytest.warns(DeprecationWarning, match="codec_group"),
        pytest.raises(ValueError, match=r"^codec\.group: 3 is not an integer"),
    ):
        Config(codec_group=3)  # type: ignore[call-arg]
    with (
        pytest.warns(DeprecationWarning, match="codec"),
        pytest.raises(ValueError, match=r"^codec\.name: 'int3' is not one of"),
    ):
        Offloader(tier="keep", codec="int3")


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
