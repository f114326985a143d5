"""The lab, ``scripts/``, against what its README and the docs say of it.

- every path under ``scripts/`` that the README, docs/, the package, the tests or the scripts
  themselves name (``scripts/NAME.py``, ``python -m scripts.NAME``) exists: a script renamed or
  deleted leaves no command behind that cannot run;
- scripts/README.md has a row for every script, and for nothing that is gone;
- every result file of docs/benchmarks/ is named as scripts/README.md says, but the few older
  ones it names.

The scripts' ``--help`` is not run here: most import torch, and all of them together take over a
minute on two cores. That the package never imports ``scripts`` is tests/test_layout.py's.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAB = ROOT / "scripts"
LAB_README = LAB / "README.md"
RESULTS = ROOT / "docs" / "benchmarks"

# -- paths the repository names ----------------------------------------------------------------

_PATH = re.compile(r"(?<![\w.-])scripts/([\w./-]*[\w/])")
_MODULE = re.compile(r"-m\s+scripts\.([\w.]*\w)")


def naming_files() -> list[Path]:
    """The files whose text may name a script: the README, the docs, the package, the tests
    (but this one, whose samples name scripts that do not exist), and the lab itself."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "offloadd").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    files += sorted(p for p in LAB.rglob("*") if p.suffix in (".py", ".sh", ".md"))
    return [p for p in files if p != Path(__file__).resolve()]


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line, path from the repository root) of every script a text names, as a path or as the
    module ``python -m`` runs (a package's folder, or a module's file). Placeholders in capitals
    (``scripts/NAME.py``) are not names."""
    found: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        for m in _PATH.finditer(line):
            found.append((number, f"scripts/{m.group(1)}"))
        for m in _MODULE.finditer(line):
            found.append((number, "scripts/" + m.group(1).replace(".", "/")))
    return [(n, p) for n, p in found if not Path(p).stem.isupper()]


def _exists(path: str) -> bool:
    target = ROOT / path
    return target.exists() or target.with_suffix(".py").is_file()


def test_every_script_the_repository_names_exists() -> None:
    missing = [
        f"{path.relative_to(ROOT)}:{number}: {named}"
        for path in naming_files()
        for number, named in named_paths(path.read_text(encoding="utf-8"))
        if not _exists(named)
    ]
    assert not missing, "scripts named that do not exist:\n" + "\n".join(missing)


def test_named_paths_reads_paths_and_modules() -> None:
    text = (
        "python scripts/io_floor.py --mode whole\n"
        "`scripts/codec_error/` (`python -m scripts.codec_error`), scripts/corpus_sweep.py.\n"
        "python scripts/NAME.py, /work/main/scripts/gpu_check.sh, my_scripts/x.py\n"
        "python -m  scripts.codec_error.ops\n"
    )
    assert named_paths(text) == [
        (1, "scripts/io_floor.py"),
        (2, "scripts/codec_error/"),
        (2, "scripts/corpus_sweep.py"),
        (2, "scripts/codec_error"),
        (3, "scripts/gpu_check.sh"),
        (4, "scripts/codec_error/ops"),
    ]
    assert _exists("scripts/codec_error/ops") and not _exists("scripts/bench_step.py")


# -- the README's list ---------------------------------------------------------------------------

_ROW = re.compile(r"^\|\s*`([\w-]+(?:\.py|\.sh|/))`\s*\|", re.MULTILINE)


def lab_scripts() -> set[str]:
    """The scripts of the lab as the README names them: ``name.py``, ``name.sh``, or ``name/``
    for a package run with ``python -m``."""
    names = set()
    for p in LAB.iterdir():
        if p.is_dir() and (p / "__init__.py").is_file():
            names.add(f"{p.name}/")
        elif p.suffix in (".py", ".sh") and p.name != "__init__.py":
            names.add(p.name)
    return names


def test_the_readme_lists_every_script_once() -> None:
    listed = _ROW.findall(LAB_README.read_text(encoding="utf-8"))
    repeated = sorted({n for n in listed if listed.count(n) > 1})
    assert not repeated, f"scripts/README.md lists these twice: {repeated}"
    scripts = lab_scripts()
    unlisted = sorted(scripts - set(listed))
    gone = sorted(set(listed) - scripts)
    assert not unlisted, f"scripts without a row in scripts/README.md: {unlisted}"
    assert not gone, f"rows of scripts/README.md for scripts that are gone: {gone}"


# -- result names --------------------------------------------------------------------------------

_FIELD = r"[a-z0-9]+(?:[-.][a-z0-9]+)*"
_MACHINE = r"cpu-\d+core|[a-z]+\d+[a-z0-9]*"
RESULT_NAME = re.compile(
    rf"{_FIELD}(?:_{_FIELD})*_(?:{_MACHINE})_(?P<date>\d{{4}}-\d\d-\d\d)(?:_{_FIELD})?"
    r"\.(?:md|json|jsonl|csv|png)"
)
"""``<topic>[_<subject>...]_<machine>_<YYYY-MM-DD>[_<variant>].<ext>`` (scripts/README.md)."""

OLDER_NAMES = (
    "core_cpu-2core_mmap-threshold_2026-11-22.md",
    "core_cpu-2core_no-trim_2026-11-22.md",
    "relay_llama-32_host-cache_cpu-2core_2026-11-27-guard.json",
)
"""Results named before the rule, kept because pages link them (scripts/README.md names them)."""


def follows_the_rule(name: str) -> bool:
    m = RESULT_NAME.fullmatch(name)
    if m is None:
        return False
    try:
        datetime.date.fromisoformat(m.group("date"))
    except ValueError:
        return False
    return True


def _results() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")


def test_result_files_are_named_by_the_rule() -> None:
    wrong = [n for n in _results() if n not in OLDER_NAMES and not follows_the_rule(n)]
    assert not wrong, (
        "docs/benchmarks/ files not named <topic>[_<subject>...]_<machine>_<YYYY-MM-DD>"
        f"[_<variant>].<ext> (scripts/README.md): {wrong}"
    )


def test_the_older_names_are_still_there_and_still_older() -> None:
    readme = LAB_README.read_text(encoding="utf-8")
    for name in OLDER_NAMES:
        assert name in _results(), f"{name} is gone: drop it from OLDER_NAMES and the README"
        assert not follows_the_rule(name), f"{name} follows the rule: drop it from OLDER_NAMES"
        assert name in readme, f"scripts/README.md does not name {name} among the older names"


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("rok-steady_mini-gpt_cpu-2core_2026-11-27.png", True),
        ("hooks-round2_gpt2_cpu-2core_2026-12-05_before.json", True),
        ("auto-paired_hf-gpt2_cpu-2core_2026-11-27_60-rounds-0.2x.json", True),
        ("native-io_cpu-2core_2026-11-22_32-threads.json", True),
        ("gpu_h200_2026-11-27.md", True),
        ("steady-pool_ab_hf-gpt2_cpu-2core_2026-11-26.jsonl", True),
        ("rok_mini-gpt_2026-11-24.md", False),  # no machine
        ("rok_mini-gpt_cpu-2core.md", False),  # no date
        ("rok_mini-gpt_cpu-2core_2026-13-01.md", False),  # no such day
        ("rok_mini-gpt_cpu-2core_26-11-24.md", False),  # not ISO
        ("ROK_mini-gpt_cpu-2core_2026-11-24.md", False),  # capitals
        ("rok_mini_gpt_cpu-2core_2026-11-24_a_b.md", False),  # two variants
        ("rok_mini-gpt_cpu-2core_2026-11-24.txt", False),  # not a result's kind
    ],
)
def test_the_rule_on_made_up_names(name: str, ok: bool) -> None:
    assert follows_the_rule(name) is ok
