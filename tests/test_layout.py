"""The package's layout: which room of offloadd may import which, and the tools' shape.

The rooms are the folders and top-level modules of ``offloadd/`` (and ``offloadd_boot.py``
beside it). :data:`ROOMS` says which rooms each may import; it mirrors the table of
docs/architecture.md row for row, and the tests hold all three to each other:

- every import of every module, counting those inside functions and ``importlib.import_module``
  calls with a literal name (imports under ``if TYPE_CHECKING:`` are for the type checker and
  do not count), goes to a room its row allows;
- the rooms import as a DAG (no cycle, whatever the table allows);
- the table covers every folder and top-level file, and names nothing that is gone; the
  documented table is the same as :data:`ROOMS`;
- inside a room, modules import as a DAG too, this time counting ``TYPE_CHECKING`` imports: a
  module typed by the one that holds it holds its parent (pass it narrow callables instead).

The subcommands of ``offloadd`` (``cli._COMMANDS``) and the package root's public names
(``offloadd._HOMES``) are imported by name on first use; their tables count as imports.

The experiments of ``scripts/`` (scripts/README.md) stand outside the package: they may import
offloadd, and no module of the distribution imports them, read the same way.

``offloadd.tools`` (demo, plan, bench/, rok/, doctor/, harness/, models/) is built on offloadd and
nothing imports it
but the tools and ``offloadd.cli``: checked statically (the table) and by running (a fresh
interpreter imports every module outside the tools, runs each subcommand's ``--help``, or trains
a step under ``OFFLOADD=1``, and then holds no ``offloadd.tools`` module). ``offloadd --help``
and ``offloadd --version`` import no torch. Every module of the tools also stays under 400
lines and declares its public names in ``__all__``; each folder of the tools is a package (an
``__init__.py``), whose modules do not repeat its name (``rok/points.py``, not ``rok/rok_points.py``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "offloadd"
TOP_LEVEL = (ROOT / "offloadd_boot.py",)  # modules installed next to the package
TOOLS = PACKAGE / "tools"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# -- the rooms -------------------------------------------------------------------------------

ANYTHING = ("*",)
"""A room that may import every other (the tools)."""

ROOMS: dict[str, tuple[str, ...]] = {
    "config/": (),
    "units.py": (),
    "trace.py": (),
    "wire/": (),
    "cli_dirs.py": (),
    "io/": ("config/",),
    "backend/": ("config/", "io/", "wire/", "units.py", "trace.py"),
    "daemon/": ("config/", "io/", "wire/", "cli_dirs.py"),
    "runtime/": ("config/", "io/", "backend/", "units.py", "trace.py"),
    "codec/": ("config/", "runtime/"),
    "auto/": ("config/", "runtime/", "units.py"),
    "offloader.py": ("config/", "io/", "runtime/", "auto/", "codec/"),
    "memsave/": (),
    "relay/": ("config/", "io/", "backend/", "runtime/", "units.py", "trace.py"),
    "integrations/": (
        "config/",
        "io/",
        "backend/",
        "runtime/",
        "auto/",
        "memsave/",
        "relay/",
        "offloader.py",
        "units.py",
        "cli_dirs.py",
    ),
    "offloadd_boot.py": ("integrations/",),
    "integrations/_bootstrap/": ("offloadd_boot.py",),
    "__init__.py": (
        "config/",
        "io/",
        "backend/",
        "runtime/",
        "memsave/",
        "relay/",
        "offloader.py",
    ),
    "cli.py": ("__init__.py", "backend/", "daemon/", "integrations/", "tools/"),
    "__main__.py": ("cli.py",),
    "tools/": ANYTHING,
}
"""Room -> the rooms it may import: docs/architecture.md's table, row for row."""

LAZY_TABLES = {"offloadd.cli": "_COMMANDS", "offloadd": "_HOMES"}
"""Modules that import by name from a dict literal (name -> module): its values count."""

KNOWN_CYCLES: tuple[frozenset[str], ...] = ()
"""Module cycles inside a room that are known and left for now (each must still exist)."""


def module_name(path: Path) -> str:
    """``offloadd/io/files.py`` -> ``offloadd.io.files``; a package's ``__init__`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str:
    """The room of a module: ``offloadd.io.files`` -> ``io/``, ``offloadd.cli`` -> ``cli.py``."""
    if module.split(".")[0] != "offloadd":
        return f"{module}.py"
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    if parts[1:3] == ["integrations", "_bootstrap"]:
        return "integrations/_bootstrap/"  # run as a top-level sitecustomize from PYTHONPATH
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def existing_rooms() -> set[str]:
    """Every folder and top-level module of the package, and the modules installed beside it."""
    rooms = {
        f"{p.name}/" if p.is_dir() else p.name
        for p in PACKAGE.iterdir()
        if not p.name.startswith(".")
        and p.name != "__pycache__"
        and (p.is_dir() or p.suffix == ".py")
    }
    if (PACKAGE / "integrations" / "_bootstrap").is_dir():
        rooms.add("integrations/_bootstrap/")
    return rooms | {p.name for p in TOP_LEVEL if p.exists()}


def documented_rooms(text: str) -> dict[str, tuple[str, ...]]:
    """The rooms table of docs/architecture.md (``| room | role | may import |``): the room of
    each row and the rooms its last cell names (``nothing``: none; ``anything``: every one)."""
    rows: dict[str, tuple[str, ...]] = {}
    lines = iter(text.splitlines())
    for line in lines:
        if line.replace(" ", "") == "|room|role|mayimport|":
            next(lines)  # |---|---|---|
            break
    else:
        raise AssertionError(f"{ARCHITECTURE}: no table headed | room | role | may import |")
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        assert len(names) == 1, f"{ARCHITECTURE}: a row names one room first: {line!r}"
        last = cells[-1]
        allowed = ANYTHING if last.startswith("anything") else tuple(re.findall(r"`([^`]+)`", last))
        assert allowed or last.startswith("nothing"), f"{ARCHITECTURE}: {line!r}"
        rows[names[0]] = allowed
    return rows


# -- reading imports -------------------------------------------------------------------------


def source_files() -> list[Path]:
    """Every module of the distribution: the package's ``.py`` and ``.pyi`` files, and the
    top-level modules installed beside it."""
    files = sorted(p for p in PACKAGE.rglob("*.py*") if p.suffix in (".py", ".pyi"))
    return files + [p for p in TOP_LEVEL if p.exists()]


def extension_modules() -> set[str]:
    """The package's compiled extensions: those setup.py builds, and any built here."""
    names = set(
        re.findall(r"\w*Extension\(\s*[\"'](offloadd\.[\w.]+)[\"']", _read(ROOT / "setup.py"))
    )
    for p in PACKAGE.rglob("*"):
        if p.suffix in (".so", ".pyd"):
            names.add(module_name(p.with_name(p.name.split(".")[0])))
    return names


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def known_modules() -> set[str]:
    return {module_name(p) for p in source_files()} | extension_modules()


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    importer: str
    target: str
    """The module this statement makes Python import (the deepest one it names)."""
    text: str
    """The statement as written, for messages."""
    type_only: bool = False
    """Under ``if TYPE_CHECKING:``: for the type checker, never run."""

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_IMPORT_CALLS = {"import_module", "__import__"}


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _lazy_table(tree: ast.Module, name: str) -> Iterable[tuple[ast.expr, str]]:
    """The module names of a module-level ``name = {...: "module"}``."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            assert isinstance(node, ast.Assign | ast.AnnAssign)
            if isinstance(node.value, ast.Dict):
                for v in node.value.values:
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        yield v, v.value


def read_imports(
    path: Path, source: str | None = None, modules: set[str] | None = None
) -> list[Import]:
    """Every import of a module of ``offloadd`` (or the top-level modules) by the file at
    ``path``, wherever it stands: module level, functions, ``try`` or ``TYPE_CHECKING`` blocks
    (those marked ``type_only``), and the module names of its lazy table, if it has one.

    ``from package import name`` imports ``package.name`` when that is a module, else
    ``package``; relative imports are resolved against the file's package."""
    text = path.read_text() if source is None else source
    modules = known_modules() if modules is None else modules
    importer = module_name(path)
    is_package = path.stem == "__init__"
    own_package = importer if is_package else importer.rpartition(".")[0]
    ours = {m.split(".")[0] for m in modules}
    found: list[Import] = []

    def add(node: ast.AST, target: str, type_only: bool) -> None:
        if target.split(".")[0] in ours:
            line = getattr(node, "lineno", 0)
            found.append(Import(path, line, importer, target, ast.unparse(node), type_only))

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name, type_only)
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
                add(node, sub if sub in modules else base, type_only)
        elif (
            isinstance(node, ast.Call)
            and _call_name(node.func) in _IMPORT_CALLS
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node, node.args[0].value, type_only)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    tree = ast.parse(text, filename=str(path))
    visit(tree, False)
    table = LAZY_TABLES.get(importer)
    if table is not None:
        for node, target in _lazy_table(tree, table):
            add(node, target, False)
    return sorted(found, key=lambda i: i.line)


def all_imports() -> list[Import]:
    modules = known_modules()
    return [imp for p in source_files() for imp in read_imports(p, modules=modules)]


def _resolved(imports: list[Import], modules: set[str]) -> list[Import]:
    """Each import's target as a known module (``offloadd.io.Engine`` -> ``offloadd.io``)."""
    out = []
    for imp in imports:
        target = imp.target
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]
        if target in modules:
            out.append(Import(imp.path, imp.line, imp.importer, target, imp.text, imp.type_only))
    return out


# -- the rules -------------------------------------------------------------------------------


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def room_violations(imports: list[Import], rooms: dict[str, tuple[str, ...]]) -> list[str]:
    """Imports (type-only ones aside) into a room that the importer's row does not allow."""
    found = []
    for imp in imports:
        if imp.type_only:
            continue
        src, dst = room_of(imp.importer), room_of(imp.target)
        allowed = rooms.get(src, ())
        if src != dst and allowed != ANYTHING and dst not in allowed:
            found.append(
                f"{imp.where()}: `{imp.text}` imports {imp.target}: {src} may import "
                f"{', '.join(allowed) or 'nothing else of offloadd'} (docs/architecture.md)"
            )
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    nodes = sorted(set(edges) | {w for ws in edges.values() for w in ws})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def room_graph(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        src, dst = room_of(imp.importer), room_of(imp.target)
        if not imp.type_only and src != dst:
            edges.setdefault(src, set()).add(dst)
    return edges


def module_graph(imports: list[Import]) -> dict[str, set[str]]:
    """Imports between modules of one room, ``TYPE_CHECKING`` ones included."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.importer != imp.target and room_of(imp.importer) == room_of(imp.target):
            edges.setdefault(imp.importer, set()).add(imp.target)
    return edges


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return _resolved(all_imports(), known_modules())


RUNTIME_SURFACE = frozenset(
    {
        "offloadd.runtime",  # the package: Runtime, Ordering, Stats
        "offloadd.runtime.runtime",  # Runtime, for offloader.py
        "offloadd.runtime.stages",  # the plug-ins' interfaces: Planner, Coder, PlannerView, ...
        "offloadd.runtime.identity",  # what a saved tensor is
        "offloadd.runtime.stats",
        "offloadd.runtime.ordering",  # device streams and events (relay's host store)
        "offloadd.runtime.compiled",  # unseen: hooks invisible to dynamo
        "offloadd.runtime.hook_stack",  # the saved-tensor hook stack
        "offloadd.runtime.host_allocator",  # the host cache
        "offloadd.runtime.heap_trim",
        "offloadd.runtime.stall_watch",
        "offloadd.runtime.shutdown",  # moved_off_engine_thread
    }
)
"""The modules of the runtime that the rooms above it may import; the rest (blocks, dedup,
handles, capture, lifetime, writer, reader, hooks, held, ...) is the runtime's own machinery."""


def test_the_runtime_is_reached_through_its_surface(imports: list[Import]) -> None:
    """Plug-ins and the edge (auto, codec, relay, integrations, offloader.py, ...) reach the
    runtime through :data:`RUNTIME_SURFACE` only; the tools may look inside."""
    inside = [
        f"{i.where()}: {i.text}"
        for i in imports
        if i.target.startswith("offloadd.runtime")
        and i.target not in RUNTIME_SURFACE
        and not i.importer.startswith(("offloadd.runtime", "offloadd.tools"))
        and not i.type_only
    ]
    assert not inside, "the runtime's machinery imported from outside it:\n" + "\n".join(inside)


def test_every_import_goes_where_the_table_allows(imports: list[Import]) -> None:
    found = room_violations(imports, ROOMS)
    assert not found, "imports across rooms that the table does not allow:\n" + "\n".join(found)


@pytest.mark.unit
def test_the_rooms_import_as_a_dag(imports: list[Import]) -> None:
    found = cycles(room_graph(imports))
    assert not found, f"rooms that import each other: {found}"


def test_the_table_allows_no_cycle() -> None:
    """Not only what the code does: what the table allows is a DAG too."""
    edges = {room: set(allowed) for room, allowed in ROOMS.items() if allowed != ANYTHING}
    assert not cycles(edges), cycles(edges)


def test_the_table_covers_every_room() -> None:
    rooms = existing_rooms()
    missing = sorted(rooms - set(ROOMS))
    gone = sorted(set(ROOMS) - rooms)
    assert not missing, f"rooms with no row in ROOMS and docs/architecture.md: {missing}"
    assert not gone, f"rows of ROOMS and docs/architecture.md for rooms that are gone: {gone}"
    for room, allowed in ROOMS.items():
        unknown = set(allowed) - set(ROOMS) - set(ANYTHING)
        assert not unknown, f"{room} may import rooms that do not exist: {unknown}"


def drawn_rows(text: str) -> dict[str, int]:
    """Each room drawn in docs/architecture.md's layers below the line, and the row it is on
    (its first appearance; the chains above the line are the entry points)."""
    block = text.split("```")[1]
    below = block.split("─" * 20, 1)[1].splitlines()
    rows: dict[str, int] = {}
    for row, line in enumerate(below):
        for room in ROOMS:
            if re.search(rf"(?<![\w/]){re.escape(room)}(?![\w/])", line):
                rows.setdefault(room, row)
    return rows


def test_the_diagram_draws_each_room_above_what_it_imports() -> None:
    rows = drawn_rows(ARCHITECTURE.read_text())
    assert {"runtime/", "relay/", "offloader.py", "backend/", "config/"} <= set(rows), rows
    wrong = [
        f"{room} (row {rows[room]}) imports {dep} (row {rows[dep]})"
        for room, allowed in ROOMS.items()
        if room in rows
        for dep in allowed
        if dep in rows and rows[dep] <= rows[room]
    ]
    assert not wrong, "docs/architecture.md draws a room at or below one it imports: " + (
        "; ".join(wrong)
    )


def test_the_documented_table_is_the_tested_one() -> None:
    documented = documented_rooms(ARCHITECTURE.read_text())
    assert list(documented) == list(ROOMS), (
        "docs/architecture.md lists other rooms, or in another order"
    )
    for room, allowed in ROOMS.items():
        assert set(documented[room]) == set(allowed), (room, documented[room], allowed)


@pytest.mark.unit
def test_modules_of_a_room_import_as_a_dag(imports: list[Import]) -> None:
    found = [set(c) for c in cycles(module_graph(imports))]
    unknown = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unknown, f"modules that import each other (TYPE_CHECKING counted): {unknown}"
    fixed = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not fixed, f"a known cycle is gone: remove it from KNOWN_CYCLES: {fixed}"


# The checker itself, on made-up sources: each form of import it must see, and the message.
_SAMPLE = """
import os
import offloadd.tools.rok
from offloadd.tools import train
from offloadd.config import Config
from . import native, Request
from ..tools.models import build
from .. import __version__
if TYPE_CHECKING:
    from offloadd.runtime.offloader import Offloader

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
    assert [(i.line, i.target, i.type_only) for i in found] == [
        (3, "offloadd.tools.rok", False),
        (4, "offloadd.tools.train", False),
        (5, "offloadd.config", False),
        (6, "offloadd.io.native", False),
        (6, "offloadd.io", False),
        (7, "offloadd.tools.models.build", False),
        (8, "offloadd", False),
        (10, "offloadd.runtime.offloader", True),
        (13, "offloadd.runtime.offloader", False),
        (14, "offloadd.tools.demo", False),
    ]
    messages = room_violations(found, ROOMS)
    assert messages[0] == (
        "offloadd/io/sample.py:3: `import offloadd.tools.rok` imports offloadd.tools.rok: io/ "
        "may import config/ (docs/architecture.md)"
    )
    assert [int(m.split(":")[1]) for m in messages] == [3, 4, 7, 8, 13, 14]
    # the same source in the tools breaks nothing; in cli.py, only what cli.py may not import
    assert not room_violations(read_imports(TOOLS / "sample.py", _SAMPLE, modules), ROOMS)
    in_cli = room_violations(read_imports(PACKAGE / "cli.py", _SAMPLE, modules), ROOMS)
    assert [int(m.split(":")[1]) for m in in_cli] == [5, 13], in_cli


def test_cycles_are_found() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


@pytest.mark.unit
def test_every_room_has_modules(imports: list[Import]) -> None:
    """A row whose room holds no module (a package renamed) would pass silently."""
    modules = known_modules()
    assert len(modules) >= 30, sorted(modules)
    empty = set(ROOMS) - {room_of(m) for m in modules}
    assert not empty, f"rooms with no module: {sorted(empty)}"
    assert any(imp.type_only for imp in imports), "no TYPE_CHECKING import seen: reader broken?"


# -- the lab stays outside ------------------------------------------------------------------

LAB = "scripts"
"""The experiments beside the package (scripts/README.md): they import offloadd, never the
reverse, so that the package installs and runs without them."""


def lab_imports(
    path: Path, source: str | None = None, modules: set[str] | None = None
) -> list[Import]:
    """Every import of :data:`LAB` or a module in it by the file at ``path``, read as
    :func:`read_imports` reads the package's own: wherever it stands, ``TYPE_CHECKING`` blocks
    included (the type checker, run on the package alone, would not find the lab either)."""
    modules = (known_modules() if modules is None else modules) | {LAB}
    return [imp for imp in read_imports(path, source, modules) if under(imp.target, LAB)]


def test_the_package_never_imports_the_lab() -> None:
    modules = known_modules()
    found = [
        f"{imp.where()}: `{imp.text}`"
        for path in source_files()
        for imp in lab_imports(path, modules=modules)
    ]
    assert not found, (
        "the package imports scripts/ (scripts may import offloadd; offloadd never imports "
        "scripts: move what both need into offloadd):\n" + "\n".join(found)
    )


_LAB_SAMPLE = """
import scripts
import scripts.bench_compile as bench
from scripts import io_floor
from scripts.codec_error.common import SEED
from offloadd.config import Config
import scripts_elsewhere
if TYPE_CHECKING:
    from scripts.long_run import Row

def later():
    return importlib.import_module("scripts.relay_cost")
"""


def test_lab_reader_sees_every_form_of_import() -> None:
    found = lab_imports(PACKAGE / "tools" / "sample.py", _LAB_SAMPLE, {"offloadd.config"})
    assert [(i.line, i.target, i.type_only) for i in found] == [
        (2, "scripts", False),
        (3, "scripts.bench_compile", False),
        (4, "scripts", False),
        (5, "scripts.codec_error.common", False),
        (9, "scripts.long_run", True),
        (12, "scripts.relay_cost", False),
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
    assert "offloadd.runtime.runtime" in result["modules"], "OFFLOADD=1 did not activate"
    loaded = _tools_loaded(result["modules"])
    assert not loaded, f"a training step under OFFLOADD=1 loaded {', '.join(loaded)}"


_CLI_MODULES = r"""
import json, sys, time

from offloadd.cli import main

start = time.perf_counter()
try:
    main([sys.argv[1]])
except SystemExit as e:
    assert e.code == 0, e.code
print(json.dumps({"modules": sorted(sys.modules), "seconds": time.perf_counter() - start}))
"""


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_no_torch(flag: str) -> None:
    """``offloadd --help`` and ``--version`` answer at once: no torch, no subcommand module,
    under 0.3 s for the whole interpreter (the best of three runs: the machine may be busy)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    clean.pop("PYTHONPATH", None)
    walls = []
    for _ in range(3):
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", _CLI_MODULES, flag],
            env=clean,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        walls.append(time.perf_counter() - start)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        heavy = [m for m in result["modules"] if m.split(".")[0] in ("torch", "numpy")]
        assert not heavy, f"offloadd {flag} imported {heavy[:5]}"
        ours = [m for m in result["modules"] if under(m, "offloadd")]
        assert set(ours) <= {"offloadd", "offloadd.cli", "offloadd.memsave", "offloadd.relay"}, ours
    assert min(walls) < 0.3, f"offloadd {flag}: {min(walls):.2f} s at best of {walls}"


def test_the_command_runs_as_a_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "offloadd", "--version"],
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("offloadd "), proc.stderr


# -- the tools' own shape --------------------------------------------------------------------

MAX_LINES = 400


def _tool_files() -> list[Path]:
    return sorted(TOOLS.rglob("*.py"))


@pytest.mark.unit
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


def _tool_folders() -> list[Path]:
    return sorted(p for p in TOOLS.rglob("*") if p.is_dir() and p.name != "__pycache__")


@pytest.mark.unit
@pytest.mark.parametrize("folder", _tool_folders(), ids=lambda p: str(p.relative_to(TOOLS)))
def test_tool_folder_is_a_package_named_once(folder: Path) -> None:
    """A folder of the tools is a package with its own ``__init__.py`` (its ``__all__`` is
    checked above), and its modules are named by role inside it, without its name again."""
    where = folder.relative_to(ROOT)
    assert (folder / "__init__.py").is_file(), f"{where}: no __init__.py"
    repeated = [
        p.name
        for p in folder.glob("*.py")
        if p.stem == folder.name or p.stem.startswith(f"{folder.name}_")
    ]
    assert not repeated, f"{where}: modules named after their package again: {repeated}"


# -- the tests' own shape --------------------------------------------------------------------

TESTS = ROOT / "tests"
TEST_FOLDERS_BESIDE_ROOMS = {
    "properties": "what every configuration keeps: equivalence, lossless, corpus, matrix",
    "_support": "what the tests share, and the scripts they launch",
}


@pytest.mark.unit
def test_tests_mirror_the_package() -> None:
    """``tests/`` has one folder per room of ``offloadd/`` that has tests, plus
    :data:`TEST_FOLDERS_BESIDE_ROOMS`; each is a package (unique module names); at the top only
    ``conftest.py`` and the tests of the whole repository, no shared modules."""
    folders = {
        p.name
        for p in TESTS.iterdir()
        if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")
    }
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    strays = sorted(folders - rooms - set(TEST_FOLDERS_BESIDE_ROOMS))
    assert not strays, f"folders of tests/ that name no room of offloadd/: {strays}"
    missing = sorted(f for f in folders if not (TESTS / f / "__init__.py").is_file())
    assert not missing, f"folders of tests/ without __init__.py: {missing}"
    loose = sorted(
        p.name
        for p in TESTS.glob("*.py")
        if p.name not in ("__init__.py", "conftest.py") and not p.name.startswith("test_")
    )
    assert not loose, f"shared modules at the top of tests/ (they go to tests/_support/): {loose}"


_CLIENT_MODULES = r"""
import json, os, sys

from offloadd.cli import main

class Became(Exception):
    pass


def become(*args):  # where `run` would become its command
    raise Became


os.execvpe = become
try:
    main(json.loads(sys.argv[1]))
except Became:
    pass
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize(
    ("argv", "checked"),
    [
        (["run", "--", "true"], "offloadd.integrations.settings"),
        (["status", "--socket", "/nonexistent/daemon.sock"], "offloadd.backend.cmd_status"),
        (["stop", "--socket", "/nonexistent/daemon.sock"], "offloadd.backend.cmd_stop"),
    ],
    ids=["run", "status", "stop"],
)
def test_launcher_and_daemon_clients_import_no_torch(argv: list[str], checked: str) -> None:
    """``offloadd run`` checks the command's environment (every ``OFFLOADD_*`` variable, the
    config file) and execs it, and ``status`` and ``stop`` talk to a daemon that has no torch
    either: none of them needs torch (1.5 s of CPU before every training script, every query)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    clean.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", _CLIENT_MODULES, json.dumps(argv)],
        env={**clean, "OFFLOADD_TIER": "keep"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    assert checked in modules  # the command ran
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "numpy")]
    assert not heavy, f"offloadd {argv[0]} imported {heavy[:5]}"
