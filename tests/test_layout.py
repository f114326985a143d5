"""The package's layout: which of offloadd's packages may import which, and the tools' shape.

The rules are written by package prefix, so that modules can move and split inside a package
without touching this file:

- ``offloadd.tools`` (demo, train, bench, rok, models) is built on offloadd; the runtime never
  imports it. Only ``offloadd.tools`` itself and ``offloadd.cli`` (the command's table) may.
- ``offloadd.io`` (requests, engines, buffers, offload files) sits under everything else: it may
  import ``offloadd.config`` and itself, nothing else of offloadd (not the package root either,
  whose ``__init__`` imports the runtime).
- ``offloadd.config`` imports nothing of offloadd but itself.

They are checked statically (every ``import`` in every module, those inside functions included,
and ``importlib.import_module``/``__import__`` calls with a literal name) and, for the first
rule, by running: a fresh interpreter imports every module outside the tools, runs each
subcommand's ``--help`` outside the tools, or trains a step under ``OFFLOADD=1``, and then holds
no ``offloadd.tools`` module.

Every module of the tools also stays under 400 lines and declares its public names in
``__all__``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "offloadd"
TOP_LEVEL = (ROOT / "offloadd_boot.py",)  # modules installed next to the package
TOOLS = PACKAGE / "tools"


# -- reading imports -------------------------------------------------------------------------


def module_name(path: Path) -> str:
    """``offloadd/io/files.py`` -> ``offloadd.io.files``; a package's ``__init__`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    """Every module of the distribution: the package's ``.py`` and ``.pyi`` files, and the
    top-level modules installed beside it."""
    files = sorted(p for p in PACKAGE.rglob("*.py*") if p.suffix in (".py", ".pyi"))
    return files + [p for p in TOP_LEVEL if p.exists()]


def known_modules() -> set[str]:
    return {module_name(p) for p in source_files()}


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    importer: str
    target: str
    """The module this statement makes Python import (the deepest one it names)."""
    text: str
    """The statement as written, for messages."""

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_IMPORT_CALLS = {"import_module", "__import__"}


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def read_imports(
    path: Path, source: str | None = None, modules: set[str] | None = None
) -> list[Import]:
    """Every import of a module of ``offloadd`` (or the top-level modules) by the file at
    ``path``, wherever it stands: module level, functions, ``try`` or ``TYPE_CHECKING`` blocks.

    ``from package import name`` imports ``package.name`` when that is a module, else
    ``package``; relative imports are resolved against the file's package."""
    text = path.read_text() if source is None else source
    modules = known_modules() if modules is None else modules
    importer = module_name(path)
    is_package = path.stem == "__init__"
    own_package = importer if is_package else importer.rpartition(".")[0]
    ours = {m.split(".")[0] for m in modules}
    found: list[Import] = []

    def add(node: ast.stmt | ast.expr, target: str) -> None:
        if target.split(".")[0] in ours:
            found.append(Import(path, node.lineno, importer, target, ast.unparse(node)))

    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = own_package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: -(node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(node, sub if sub in modules else base)
        elif (
            isinstance(node, ast.Call)
            and _call_name(node.func) in _IMPORT_CALLS
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node, node.args[0].value)
    return sorted(found, key=lambda i: i.line)


def all_imports() -> list[Import]:
    modules = known_modules()
    return [imp for p in source_files() for imp in read_imports(p, modules=modules)]


# -- the rules -------------------------------------------------------------------------------


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@dataclass(frozen=True)
class Rule:
    name: str
    why: str
    importers: tuple[str, ...]
    """The rule covers modules under these prefixes ("" covers every module)."""
    exempt: tuple[str, ...] = ()
    """Importers the rule leaves alone."""
    forbidden: tuple[str, ...] = ()
    """Targets under these prefixes break the rule."""
    only: tuple[str, ...] | None = None
    """If set, targets of offloadd not under these prefixes break the rule."""

    def covers(self, importer: str) -> bool:
        return any(p == "" or under(importer, p) for p in self.importers) and not any(
            under(importer, p) for p in self.exempt
        )

    def broken_by(self, imp: Import) -> bool:
        if not self.covers(imp.importer) or not under(imp.target, "offloadd"):
            return False
        if any(under(imp.target, p) for p in self.forbidden):
            return True
        return self.only is not None and not any(under(imp.target, p) for p in self.only)


RULES = (
    Rule(
        name="tools-apart",
        why="offloadd.tools is built on offloadd; only the tools and offloadd.cli import it",
        importers=("",),
        exempt=("offloadd.tools", "offloadd.cli"),
        forbidden=("offloadd.tools",),
    ),
    Rule(
        name="io-at-the-bottom",
        why="offloadd.io imports only offloadd.io and offloadd.config (not the package root: "
        "offloadd/__init__.py imports the runtime)",
        importers=("offloadd.io",),
        only=("offloadd.io", "offloadd.config"),
    ),
    Rule(
        name="config-alone",
        why="offloadd.config imports nothing of offloadd but itself",
        importers=("offloadd.config",),
        only=("offloadd.config",),
    ),
)


def violations(imports: list[Import]) -> list[str]:
    return [
        f"{imp.where()}: `{imp.text}` imports {imp.target} [{rule.name}: {rule.why}]"
        for rule in RULES
        for imp in imports
        if rule.broken_by(imp)
    ]


def test_import_boundaries_hold() -> None:
    found = violations(all_imports())
    assert not found, "imports across package boundaries:\n" + "\n".join(found)


def test_every_rule_covers_modules_that_exist() -> None:
    """A rule whose prefix matches no module (a package renamed) would pass silently."""
    modules = known_modules()
    assert len(modules) >= 30, sorted(modules)
    for rule in RULES:
        assert any(rule.covers(m) for m in modules), rule.name
        for prefix in rule.forbidden + (rule.only or ()):
            assert any(under(m, prefix) for m in modules), f"{rule.name}: no module {prefix}"


# The checker itself, on made-up sources: each form of import it must see, and the message.
_SAMPLE = """
import os
import offloadd.tools.rok
from offloadd.tools import train
from offloadd.config import Config
from . import native, Request
from ..tools.models import build
from .. import __version__

def later():
    from offloadd.runtime.offloader import Offloader
    importlib.import_module("offloadd.tools.demo")
    return __import__("json")
"""


def test_reader_sees_every_form_of_import() -> None:
    modules = {
        "offloadd",
        "offloadd.config",
        "offloadd.io",
        "offloadd.io.native",
        "offloadd.io.sample",
        "offloadd.runtime.offloader",
        "offloadd.tools",
        "offloadd.tools.demo",
        "offloadd.tools.models",
        "offloadd.tools.models.build",
        "offloadd.tools.rok",
        "offloadd.tools.train",
    }
    path = PACKAGE / "io" / "sample.py"
    found = read_imports(path, _SAMPLE, modules)
    assert [(i.line, i.target) for i in found] == [
        (3, "offloadd.tools.rok"),
        (4, "offloadd.tools.train"),
        (5, "offloadd.config"),
        (6, "offloadd.io.native"),
        (6, "offloadd.io"),
        (7, "offloadd.tools.models.build"),
        (8, "offloadd"),
        (11, "offloadd.runtime.offloader"),
        (12, "offloadd.tools.demo"),
    ]
    messages = violations(found)
    assert messages[0] == (
        "offloadd/io/sample.py:3: `import offloadd.tools.rok` imports offloadd.tools.rok "
        f"[tools-apart: {RULES[0].why}]"
    )
    broken = {(m.split(":")[1], m.split("[")[1].split(":")[0]) for m in messages}
    assert broken == {
        ("3", "tools-apart"),
        ("4", "tools-apart"),
        ("7", "tools-apart"),
        ("12", "tools-apart"),
        ("3", "io-at-the-bottom"),
        ("4", "io-at-the-bottom"),
        ("7", "io-at-the-bottom"),
        ("8", "io-at-the-bottom"),
        ("11", "io-at-the-bottom"),
        ("12", "io-at-the-bottom"),
    }
    # the same source in the tools or in cli.py breaks nothing of tools-apart
    for where in (TOOLS / "sample.py", PACKAGE / "cli.py"):
        assert not [
            m for m in violations(read_imports(where, _SAMPLE, modules)) if "tools-apart" in m
        ]


# -- the same, by running --------------------------------------------------------------------

_IMPORT_ALL = r"""
import importlib, json, os, pkgutil, sys

import offloadd

SKIP = {"offloadd.__main__", "offloadd.integrations._bootstrap.sitecustomize"}  # they act


def walk(path, prefix):
    for info in pkgutil.iter_modules([path]):
        name = prefix + info.name
        if name == "offloadd.tools" or name in SKIP:
            continue  # never imported, not even to list it
        yield name
        if info.ispkg:
            yield from walk(os.path.join(path, info.name), name + ".")


imported, missing = [], {}
for name in walk(offloadd.__path__[0], "offloadd."):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:  # an optional dependency that is not installed
        if (e.name or "").split(".")[0] == "offloadd":
            raise
        missing[name] = str(e)
    else:
        imported.append(name)
print(json.dumps({"imported": imported, "missing": missing, "modules": sorted(sys.modules)}))
"""

_HELP_ALL = r"""
import json, sys

from offloadd import cli

ran = []
for name, module in cli._COMMANDS.items():
    if module.startswith("offloadd.tools"):
        continue
    try:
        cli.main([name, "--help"])
    except SystemExit as e:
        assert e.code == 0, (name, e.code)
    ran.append(name)
print(json.dumps({"ran": ran, "modules": sorted(sys.modules)}))
"""

_TRAIN_STEP = r"""
import json, sys

import torch

model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
model(torch.randn(64, 256)).square().mean().backward()
print(json.dumps({"modules": sorted(sys.modules)}))
"""


def _probe(code: str, **env: str) -> dict[str, list[str]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    clean.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, list[str]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _tools_loaded(modules: list[str]) -> list[str]:
    return [m for m in modules if under(m, "offloadd.tools")]


def test_importing_everything_but_the_tools_loads_no_tool() -> None:
    result = _probe(_IMPORT_ALL)
    loaded = _tools_loaded(result["modules"])
    assert not loaded, f"importing every module outside the tools loaded {', '.join(loaded)}"
    for package in ("config", "io", "runtime", "backend", "daemon", "integrations"):
        assert any(under(m, f"offloadd.{package}") for m in result["imported"]), result


def test_commands_outside_the_tools_load_no_tool() -> None:
    result = _probe(_HELP_ALL)
    assert {"serve", "status", "stop", "run"} <= set(result["ran"]), result["ran"]
    loaded = _tools_loaded(result["modules"])
    assert not loaded, f"offloadd {{{','.join(result['ran'])}}} --help loaded {', '.join(loaded)}"


def test_offloading_a_training_step_loads_no_tool(tmp_path: Path) -> None:
    result = _probe(
        _TRAIN_STEP,
        OFFLOADD="1",
        OFFLOADD_SSD_DIRS=str(tmp_path),
        OFFLOADD_MIN_BYTES="16KiB",
    )
    assert "offloadd.runtime.offloader" in result["modules"], "OFFLOADD=1 did not activate"
    loaded = _tools_loaded(result["modules"])
    assert not loaded, f"a training step under OFFLOADD=1 loaded {', '.join(loaded)}"


# -- the tools' own shape --------------------------------------------------------------------

MAX_LINES = 400


def _tool_files() -> list[Path]:
    return sorted(TOOLS.rglob("*.py"))


@pytest.mark.parametrize("path", _tool_files(), ids=lambda p: str(p.relative_to(TOOLS)))
def test_tool_module_is_short(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_LINES})"


def _defined_at_module_level(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _public_definitions(tree: ast.Module) -> set[str]:
    """Functions, classes and constants (UPPER_CASE) the module defines without a leading _."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper())
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("path", _tool_files(), ids=lambda p: str(p.relative_to(TOOLS)))
def test_tool_module_declares_its_public_names(path: Path) -> None:
    """Every tools module lists its public names in a literal ``__all__``: each one exists, and
    every public function, class and constant it defines is in it (or is renamed ``_private``)."""
    where = path.relative_to(ROOT)
    tree = ast.parse(path.read_text(), filename=str(path))
    declared = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and any(
            isinstance(t, ast.Name) and t.id == "__all__"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    assert len(declared) == 1, f"{where}: no __all__ (or more than one)"
    value = declared[0].value
    assert isinstance(value, ast.List | ast.Tuple) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
    ), f"{where}:{declared[0].lineno}: __all__ must be a literal list of names"
    names = [e.value for e in value.elts if isinstance(e, ast.Constant)]
    assert len(names) == len(set(names)), f"{where}: __all__ repeats a name"
    undefined = set(names) - _defined_at_module_level(tree)
    assert not undefined, f"{where}: __all__ names what the module does not define: {undefined}"
    unlisted = _public_definitions(tree) - set(names)
    assert not unlisted, f"{where}: public but not in __all__ (export it or prefix _): {unlisted}"
