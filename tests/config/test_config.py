from __future__ import annotations

import warnings
from dataclasses import fields
from pathlib import Path

import pytest

from offloadd import Config, Offloader
from offloadd.config import CodecConfig, DaemonConfig, parse_size

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_work_and_match_default_toml() -> None:
    assert Config.from_toml(ROOT / "configs" / "default.toml") == Config()
    # what changes a model or loses bits is asked for, never on by default
    assert Config().memsave is False and Config().codec.name == "none" and Config().budget is None


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


# -- the daemon's section ---------------------------------------------------------------------


def test_keys_and_variables_map_one_to_one() -> None:
    from offloadd.config import env_var

    top = {f.name for f in fields(Config)}
    # OFFLOADD_<SECTION>_<KEY> is a section's: no top-level key may start with a section's name
    assert not [k for k in top if k.startswith(("daemon_", "codec_"))]
    keys = [
        *(top - {"daemon", "codec"}),
        *(f"daemon.{f.name}" for f in fields(DaemonConfig)),
        *(f"codec.{f.name}" for f in fields(CodecConfig)),
    ]
    assert len({env_var(k) for k in keys}) == len(keys)
    assert env_var("daemon.quota_bytes") == "OFFLOADD_DAEMON_QUOTA_BYTES"
    assert env_var("codec.min_bytes") == "OFFLOADD_CODEC_MIN_BYTES"


def test_every_field_declares_its_kind_once() -> None:
    """Each key's kind lives in its field's metadata; no second table of kinds exists."""
    import importlib
    import pkgutil

    import offloadd.config
    from offloadd.config.fields import KIND, Section

    def is_kind(value: object) -> bool:
        return isinstance(getattr(value, "what", None), str) and callable(
            getattr(value, "read", None)
        )

    for cls in (Config, DaemonConfig, CodecConfig):
        for f in fields(cls):
            assert is_kind(f.metadata.get(KIND)), (cls.__name__, f.name)
    sections = {
        f.name: f.metadata[KIND] for f in fields(Config) if isinstance(f.metadata[KIND], Section)
    }
    assert {k: s.cls for k, s in sections.items()} == {"daemon": DaemonConfig, "codec": CodecConfig}
    for info in pkgutil.iter_modules(offloadd.config.__path__):
        module = importlib.import_module(f"offloadd.config.{info.name}")
        tables = [
            name
            for name, value in vars(module).items()
            if isinstance(value, dict) and value and all(map(is_kind, value.values()))
        ]
        assert not tables, (info.name, tables)  # a dict of kinds would be a second declaration
    assert not (ROOT / "offloadd" / "config" / "kinds.py").exists()


def test_config_files_document_every_key() -> None:
    import tomllib

    with (ROOT / "configs" / "default.toml").open("rb") as f:
        default = tomllib.load(f)
    with (ROOT / "configs" / "daemon.toml").open("rb") as f:
        daemon = tomllib.load(f)
    assert set(default["offload"]) == {f.name for f in fields(Config)} - {"daemon", "codec"}
    assert set(default["codec"]) == {f.name for f in fields(CodecConfig)}
    assert set(default["daemon"]) == {"socket", "trusted_uids"}  # what the training side reads
    assert set(daemon) == {"daemon"}
    assert set(daemon["daemon"]) == {f.name for f in fields(DaemonConfig)}
    assert Config.from_toml(ROOT / "configs" / "daemon.toml") == Config()


def test_section_from_toml(tmp_path: Path) -> None:
    p = tmp_path / "both.toml"
    p.write_text(
        'min_bytes = "64k"\n'
        "[daemon]\n"
        'socket = "~/d.sock"\ndirs = ["/n0", "/n1"]\nquota_bytes = "8GiB"\n'
        "allowed_uids = [1000]\nio_threads = 8\n"
    )
    cfg = Config.from_toml(p)
    assert cfg.min_bytes == 64 << 10 and cfg.io_threads == 4  # the top level keeps its own
    d = cfg.daemon
    assert d.socket == str(Path.home() / "d.sock") and d.dirs == ("/n0", "/n1")
    assert (d.quota_bytes, d.allowed_uids, d.io_threads) == (8 << 30, (1000,), 8)
    assert d.checksum == "xxh3"  # keys not given keep their defaults
    # the same with an [offload] table, and with the section inside it
    p.write_text('[offload]\nmin_bytes = "64k"\n[daemon]\nquota_bytes = "8GiB"\n')
    assert Config.from_toml(p).daemon.quota_bytes == 8 << 30
    p.write_text('[offload]\nmin_bytes = "64k"\n[offload.daemon]\nquota_bytes = "8GiB"\n')
    assert Config.from_toml(p).daemon.quota_bytes == 8 << 30
    p.write_text("[offload]\n[offload.daemon]\nio_threads = 2\n[daemon]\nio_threads = 3\n")
    with pytest.raises(ValueError, match=r"daemon: given twice.*both\.toml"):
        Config.from_toml(p)
    p.write_text('[offload]\ntier = "keep"\n[other]\nx = 1\n')
    outside = r"other: outside the \[offload\], \[codec\], \[daemon\] tables"
    with pytest.raises(ValueError, match=outside):
        Config.from_toml(p)
    p.write_text('daemon = "/run/d.sock"\n')
    with pytest.raises(ValueError, match=r"daemon: '/run/d\.sock' is not a table"):
        Config.from_toml(p)


def test_section_from_env(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[daemon]\nchecksum = "crc32"\nquota_bytes = "1GiB"\n')
    cfg = Config.from_env(
        {
            "OFFLOADD_CONFIG": str(p),
            "OFFLOADD_DAEMON_SOCKET": " /run/d.sock ",
            "OFFLOADD_DAEMON_DIRS": "/n0,/n1",
            "OFFLOADD_DAEMON_ALLOWED_UIDS": "1000,1001",
            "OFFLOADD_DAEMON_QUOTA_BYTES": "64GiB",
            "OFFLOADD_DAEMON_DIRECT_IO": "off",
            "OFFLOADD_IO_THREADS": "2",
        }
    )
    d = cfg.daemon
    assert (d.socket, d.dirs, d.allowed_uids) == ("/run/d.sock", ("/n0", "/n1"), (1000, 1001))
    assert (d.quota_bytes, d.checksum) == (64 << 30, "crc32")  # variable over file; file's own
    assert (d.direct_io, cfg.direct_io, d.io_threads, cfg.io_threads) == ("off", "auto", 4, 2)


@pytest.mark.parametrize(
    ("var", "value", "named"),
    [
        (
            "OFFLOADD_DAEMON_QUOTA_BYTES",
            "12 apples",
            "daemon.quota_bytes: '12 apples' is not a size",
        ),
        ("OFFLOADD_DAEMON_CHECKSUM", "md5", "daemon.checksum: 'md5' is not one of xxh3"),
        ("OFFLOADD_DAEMON_IO_THREADS", "0", "daemon.io_threads: '0' is not an integer in 1..256"),
        ("OFFLOADD_DAEMON_ALLOWED_UIDS", "1000,root", "daemon.allowed_uids: '1000,root' is not"),
        ("OFFLOADD_DAEMON_MAX_CHUNK_BYTES", "2GiB", "daemon.max_chunk_bytes: '2GiB' is not a size"),
        ("OFFLOADD_MIN_BYTES", "lots", "min_bytes: 'lots' is not a size"),
        ("OFFLOADD_CODEC_GROUP", "3", "codec.group: '3' is not an integer in 8..1048576"),
        ("OFFLOADD_CODEC_NAME", "int3", "codec.name: 'int3' is not one of none, int8"),
        ("OFFLOADD_CODEC_OPS", "nn.Linear", "codec.ops: 'nn.Linear' is not a list of names"),
    ],
)
def test_errors_name_the_dotted_key_value_and_source(
    tmp_path: Path, var: str, value: str, named: str
) -> None:
    with pytest.raises(ValueError) as e:
        Config.from_env({var: value})
    assert str(e.value).startswith(named) and str(e.value).endswith(f"(from {var})")
    key = named.split(":")[0]
    section, _, name = key.rpartition(".")
    p = tmp_path / "x.toml"
    p.write_text(f"[{section}]\n" if section else "")
    with p.open("a") as f:
        f.write(f'{name} = "{value}"\n')
    with pytest.raises(ValueError) as e:
        Config.from_toml(p)
    assert str(e.value).startswith(named) and str(e.value).endswith(f"(from {p})")


def test_unknown_section_keys_list_the_valid_ones(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[daemon]\nquota = "1GiB"\nsockets = "x"\n')
    with pytest.raises(ValueError) as e:
        Config.from_toml(p)
    assert str(e.value).startswith(f"daemon.quota, daemon.sockets: unknown keys (from {p})")
    assert "the [daemon] keys are: allowed_uids, checksum, direct_io, dirs," in str(e.value)
    with pytest.raises(
        ValueError, match="OFFLOADD_DAEMON_QUOTA='1'; known: OFFLOADD_DAEMON_SOCKET"
    ):
        Config.from_env({"OFFLOADD_DAEMON_QUOTA": "1"})
    with pytest.raises(ValueError, match="OFFLOADD_DAEMON_<KEY> for the keys of the"):
        Config.from_env({"OFFLOADD_SOCKET": "/run/d.sock"})
    # daemon keys written where the top-level ones go: the error says where they belong
    # (daemon_socket, the first release's key, is read instead: tests/config/test_config_renamed.py)
    p.write_text('daemon_checksum = "crc32"\n')
    with pytest.raises(
        ValueError, match=r"daemon_checksum: unknown key.*did you mean daemon\.checksum"
    ):
        Config.from_toml(p)
    p.write_text('quota_bytes = "1GiB"\n')
    with pytest.raises(ValueError, match=r"did you mean daemon\.quota_bytes"):
        Config.from_toml(p)
    with pytest.raises(ValueError, match=r"daemon_checksum: unknown key.*daemon=\{'checksum'"):
        Offloader(tier="keep", daemon_checksum="crc32")


def test_replace_and_the_section() -> None:
    cfg = Config(min_bytes=4096)
    got = cfg.replace(daemon={"socket": "/run/d.sock"})
    assert got.daemon == DaemonConfig(socket="/run/d.sock") and got.min_bytes == 4096
    again = got.replace(daemon={"quota_bytes": "1GiB"})  # merged into the current section
    assert (again.daemon.socket, again.daemon.quota_bytes) == ("/run/d.sock", 1 << 30)
    assert again.replace(daemon=DaemonConfig()).daemon == DaemonConfig()  # the whole section
    assert Config.from_mapping(again.as_dict()) == again
    with pytest.raises(ValueError, match=r"daemon\.quota_bytes: -1 is not a size"):
        cfg.replace(daemon={"quota_bytes": -1})
    with pytest.raises(ValueError, match=r"daemon\.io_threads: 0 is not an integer"):
        DaemonConfig(io_threads=0)
    with pytest.raises(ValueError, match="daemon: 'x' is not a DaemonConfig"):
        Config(daemon="x")  # type: ignore[arg-type]


# -- the codec's section ----------------------------------------------------------------------


def test_codec_section_from_toml(tmp_path: Path) -> None:
    p = tmp_path / "codec.toml"
    p.write_text('min_bytes = "64k"\n[codec]\nname = "int4"\ngroup = 64\nops = ["linear"]\n')
    cfg = Config.from_toml(p)
    assert cfg.codec == CodecConfig(name="int4", group=64, ops=("linear",))
    assert cfg.min_bytes == 64 << 10 and cfg.codec.min_bytes == 64 << 10  # each keeps its own
    for text in (
        '[offload]\ntier = "keep"\n[codec]\nname = "int8"\n',
        '[offload]\ntier = "keep"\n[offload.codec]\nname = "int8"\n',
    ):
        p.write_text(text)
        assert Config.from_toml(p).codec.name == "int8"
    p.write_text('[codec]\nname = "int8"\nbits = 4\n')
    with pytest.raises(ValueError) as e:
        Config.from_toml(p)
    assert str(e.value).startswith(f"codec.bits: unknown key (from {p}); the [codec] keys are:")
    p.write_text('[codec]\nname = "fp8-e4m3"\nstochastic = true\n')
    with pytest.raises(ValueError, match=r"^codec\.stochastic: .*fp8-e4m3 \(values from .*"):
        Config.from_toml(p)
    p.write_text("group = 64\n")  # a section's key at the top: the error says where it goes
    with pytest.raises(ValueError, match=r"group: unknown key.*did you mean codec\.group"):
        Config.from_toml(p)


def test_codec_section_from_env_over_the_file(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[codec]\nname = "int4"\nseed = 7\n')
    env = {
        "OFFLOADD_CONFIG": str(p),
        "OFFLOADD_CODEC_NAME": "int8",
        "OFFLOADD_CODEC_SYMMETRIC": "false",
        "OFFLOADD_CODEC_MIN_BYTES": "1MiB",
        "OFFLOADD_CODEC_OPS": "linear, matmul",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names warn about nothing
        c = Config.from_env(env).codec
    assert (c.name, c.symmetric, c.seed, c.min_bytes) == ("int8", False, 7, 1 << 20)
    assert c.ops == ("linear", "matmul")
    with pytest.raises(ValueError, match="OFFLOADD_CODEC_BITS='4'; known: OFFLOADD_CODEC_NAME"):
        Config.from_env({"OFFLOADD_CODEC_BITS": "4"})
    with pytest.raises(ValueError, match="OFFLOADD_CODEC_<KEY> for the keys of the"):
        Config.from_env({"OFFLOADD_GROUP": "64"})


def test_codec_section_in_code() -> None:
    cfg = Config(codec=CodecConfig(name="int8"))
    assert cfg == Config(codec={"name": "int8"})  # type: ignore[arg-type]
    again = cfg.replace(codec={"group": 64})  # merged into the current section
    assert (again.codec.name, again.codec.group) == ("int8", 64)
    assert again.replace(codec=CodecConfig()).codec == CodecConfig()  # the whole section
    assert Config.from_mapping(again.as_dict()) == again
    assert again.as_dict()["codec"] == {**CodecConfig().as_dict(), "name": "int8", "group": 64}
    with pytest.raises(ValueError, match=r"^codec\.group: 3 is not an integer"):
        cfg.replace(codec={"group": 3})
    with pytest.raises(ValueError, match=r"^codec: \{'bits': 4\} is not a CodecConfig"):
        Config(codec={"bits": 4})  # type: ignore[arg-type]
    off = Offloader(tier="keep", codec={"name": "int8", "min_bytes": 1})
    try:
        assert off.config.codec == CodecConfig(name="int8", min_bytes=1)
    finally:
        off.close()


def test_load_layers_base_file_and_environment(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('staging_bytes = "8MiB"\n[daemon]\nsocket = "/run/file.sock"\n')
    base = Config(tier="keep", min_bytes=1)
    env = {"OFFLOADD_CONFIG": str(p), "OFFLOADD_DAEMON_SOCKET": "/run/env.sock"}
    cfg = Config.load(environ=env, base=base)
    assert (cfg.tier, cfg.min_bytes, cfg.staging_bytes) == ("keep", 1, 8 << 20)
    assert cfg.daemon.socket == "/run/env.sock"
    assert (
        Config.load(p, environ={}).daemon.socket == "/run/file.sock"
    )  # path: OFFLOADD_CONFIG unread
    assert Config.from_env(env) == Config.load(environ=env)
    # a rule between two keys names them and where the values came from
    env = {"OFFLOADD_CONFIG": str(p), "OFFLOADD_CHUNK_BYTES": "16MiB"}
    with pytest.raises(
        ValueError, match=rf"staging_bytes: .*chunk_bytes.*from {p}, OFFLOADD_CHUNK"
    ):
        Config.from_env(env)


def test_a_daemon_file_without_its_table_still_serves(tmp_path: Path) -> None:
    """configs/daemon.toml had no [daemon] table before the settings became a section: a file
    of daemon keys alone is read as that table by ``offloadd serve`` (a mixed one is not)."""
    from offloadd.config import load_daemon

    p = tmp_path / "old.toml"
    p.write_text('quota_bytes = "1MiB"\nio_threads = 2\n')
    cfg = load_daemon(p, environ={})
    assert cfg.quota_bytes == 1 << 20 and cfg.io_threads == 2
    p.write_text('quota_bytes = "1MiB"\nmin_bytes = 3\n')
    with pytest.raises(ValueError, match="quota_bytes: unknown key"):
        load_daemon(p, environ={})


def test_config_modules_import_as_a_dag() -> None:
    """No module of offloadd/config imports one that imports it back, counting imports at module
    level and inside functions (those under ``if TYPE_CHECKING:`` only name types)."""
    import ast

    folder = ROOT / "offloadd" / "config"
    names = {p.stem for p in folder.glob("*.py")} - {"__init__"}

    def imported(path: Path) -> set[str]:
        out: set[str] = set()
        pending: list[ast.AST] = [ast.parse(path.read_text())]
        while pending:
            node = pending.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    pending.extend(child.orelse)
                    continue
                if isinstance(child, ast.ImportFrom) and child.module:
                    module = child.module.removeprefix("offloadd.config")
                    if module.startswith("."):
                        out.add(module[1:])
                    elif module == "" and child.module == "offloadd.config":
                        out.add("__init__")  # the package itself
                elif isinstance(child, ast.Import):
                    out.update(a.name.removeprefix("offloadd.config.") for a in child.names)
                pending.append(child)
        return out & (names | {"__init__"})

    graph = {name: imported(folder / f"{name}.py") for name in names}
    assert not [n for n, deps in graph.items() if "__init__" in deps]  # nothing imports the package
    order: list[str] = []
    while len(order) < len(graph):  # peel modules whose imports are all placed (a DAG empties)
        ready = sorted(n for n in graph if n not in order and graph[n] <= set(order))
        assert ready, {n: sorted(d - set(order)) for n, d in graph.items() if n not in order}
        order += ready
