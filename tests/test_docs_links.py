"""The documentation's links resolve, the docs build as a site, and the README stays short.

The docs are plain Markdown, read on GitHub, in a checkout, or as the site ``mkdocs build``
makes of docs/ (mkdocs.yml); this file is their build check. The site builds with ``--strict``:
a page that links out of docs/ (a source file, configs/), which the site would not hold, fails
it, as does a broken link or anchor; such files are named in backticks instead.
Every relative link in README.md and docs/**/*.md must name a file or folder of the repository,
and a ``#fragment`` must name a heading of the Markdown file it points into (GitHub's slugs:
lowercase, spaces to ``-``, punctuation other than ``-`` and ``_`` dropped, a repeated heading
numbered ``-1``, ``-2``, ...). Links inside code (fenced blocks, backticks) are not links.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

__all__ = ["anchors", "checked_files", "github_slug", "lab_notes", "links", "problems"]

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 200

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\))?)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_LINE_ANCHOR = re.compile(r"L\d+(-L\d+)?")


def checked_files() -> list[Path]:
    """README.md and every Markdown file under docs/ (benchmark pages included)."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        m = _FENCE.match(line)
        if fence is not None:
            if m and m.group(1) == fence:
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((number, line))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before numbering repeats)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in a Markdown file's prose."""
    out: list[tuple[int, str]] = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        line = _CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)
        targets = [m.group(1) for m in _INLINE.finditer(line)]
        ref = _REFERENCE.match(line)
        if ref:
            targets.append(ref.group(1))
        out.extend((number, t[1:-1] if t.startswith("<") else t) for t in targets)
    return out


def problems(path: Path) -> list[str]:
    """What is wrong with a file's relative links: one line per broken link."""
    bad: list[str] = []
    where = path.relative_to(ROOT)
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto:, ...
            continue
        if not target:
            bad.append(f"{where}:{number}: an empty link target")
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{where}:{number}: {target!r}: no such file {dest}")
            continue
        try:
            dest.relative_to(ROOT)
        except ValueError:
            bad.append(f"{where}:{number}: {target!r}: points outside the repository")
            continue
        if not fragment:
            continue
        if dest.suffix != ".md":
            if not (dest.is_file() and _LINE_ANCHOR.fullmatch(fragment)):
                bad.append(f"{where}:{number}: {target!r}: #{fragment} in a non-Markdown target")
            continue
        if unquote(fragment) not in anchors(dest):
            bad.append(
                f"{where}:{number}: {target!r}: no heading #{fragment} in {dest.relative_to(ROOT)}"
            )
    return bad


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert problems(path) == []


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move detail to a docs/ page"
    )


def test_docs_index_lists_every_page() -> None:
    """docs/README.md links every page of docs/ (benchmark pages through their own index)."""
    index = DOCS / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    pages = [p for p in DOCS.glob("*.md") if p != index]
    pages.append(DOCS / "benchmarks" / "README.md")
    missing = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in listed]
    assert missing == [], f"docs/README.md does not link: {missing}"


def test_benchmarks_index_lists_every_page() -> None:
    """docs/benchmarks/README.md links every results page of the folder."""
    index = DOCS / "benchmarks" / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    pages = [p for p in index.parent.glob("*.md") if p != index]
    missing = sorted(p.name for p in pages if p.resolve() not in listed)
    assert missing == [], f"docs/benchmarks/README.md does not link: {missing}"


def test_no_issue_numbers_outside_the_benchmark_pages() -> None:
    """The README and the feature pages speak of features, not of the tracker's history."""
    pattern = re.compile(r"\b(issues? *#? *\d+|this issue|the issue's)\b", re.IGNORECASE)
    found = [
        f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r}"
        for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        for m in pattern.finditer(line)
    ]
    assert found == []


# -- lab notes in the code ---------------------------------------------------------------------
#
# The rule in the code, the figure in the benchmark pages: a comment, docstring or message
# states what offloadd does and why, and links the page under docs/benchmarks/ that holds the
# measurement. These patterns find what reads as a lab note: a measured time or throughput, a
# percentage, a ratio with decimals, a date, a commit hash, the machine it ran on, or who found
# what. A benchmark page's own name (it carries a date and "2-core") is left out before matching,
# as are comparisons with a target (``<= 1.02 x``), the 95 % of an interval, config examples
# (``"0.3x"``) and format specs (``{:32s}``).

_LAB_CODE_SUFFIXES = {".py", ".c", ".cpp", ".h", ".cu"}
_LAB_NUMBER = r"(?<![\w.:<>^])\d+(?:[.,]\d+)?(?:\s?[-\u2013]\s?\d+(?:\.\d+)?)?"
_LAB_NOTES = {
    # a time or a throughput: any sub-millisecond time or rate; ms and s where they read measured
    "time": re.compile(
        _LAB_NUMBER + r"\s?(?:µs|us|ns|[GMK]i?B/s)(?![\w/])"
        r"|(?:\btook|\bspent|\bran|\bfrom \d+(?:\.\d+)?\s?\w*\s?to)\s?"
        + _LAB_NUMBER
        + r"\s?(?:ms|s|seconds?)\b"
        r"|" + _LAB_NUMBER + r"\s?(?:ms|s)\s+(?:here|more|less|over|faster|slower|of (?:a|page))\b"
    ),
    "percentage": re.compile(
        r"(?<!two-sided )"
        + _LAB_NUMBER
        + r"\s?%(?!\s?(?:interval|percentile|bootstrap|confidence|\{))"
    ),
    "ratio": re.compile(
        r"(?<![\w.'\"`@,])\d+\.\d+(?:\s?[-\u2013]\s?\d+\.\d+)?\s?[x\u00d7](?![\w'\"`)]|,\S)"
        r"|(?<![\w.])\d+(?:\.\d+)?\s?[x\u00d7]\s+(?:slower|faster)\b"
        r"|\bworth (?:up to |about )?\d+(?:\.\d+)?\s?[x\u00d7]"
        r"|(?<![\w.])\d+\.\d+\s?->\s?\d+\.\d+"
    ),
    "date": re.compile(r"\b20\d\d-[01]\d(?:-[0-3]\d)?\b"),
    "commit hash": re.compile(r"(?<![\w])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w])"),
    "machine or review talk": re.compile(
        r"\b\d+-core\b|\btwo-core\b|\(\d+ cores?\)|\bthis project's\b|\bthis VM\b|\bon the VM\b"
        r"|\bdevelopment (?:VM|machine)\b|\bour (?:VM|machine)s?\b|\bmachines? we\b"
        r"|\bwe (?:measured|tried|found|saw)\b|\breview(?:er|'s| find| saw)|\ba review\b"
        r"|\bwas found\b|\bin session \d+\b|\bon a GPU here\b"
        r"|\bmeasured(?::| at| on)\s+\S*\d",
        re.IGNORECASE,
    ),
}
_LAB_LEFT_OUT = re.compile(
    r"docs/benchmarks/[\w./#-]*"  # a page's path, with its date and machine
    r"|[\w.-]+_\d{4}-\d\d-\d\d[\w.-]*\.(?:md|json|csv|png)"  # a page's name alone
    r"|(?:<=|>=|(?<!-)[<>]|[\u2264\u2265])\s*\d+(?:\.\d+)?\s?(?:[x\u00d7%]|µs|us|ms|s)?"  # a target
    r"|\b(?i:default) \d[\d.x,]*"  # a default such as 0.5x
    r"|\(\d+(?:\.\d+)?x\)"  # a config example: (0.3x)
)
LAB_NOTES_ALLOWED: tuple[tuple[str, str], ...] = (
    # Constants' justifications, at most LAB_NOTES_MAX_ALLOWED (each links its page, if any).
    # _TAIL_TIE_S's scale: arithmetic on the constant itself, no measurement behind it.
    ("offloadd/auto/solver.py", "(1 GiB at the 10th unit: 0.1 ms)"),
)
"""(file, a fragment of the line) of each lab note let stay in offloadd/ or csrc/."""
LAB_NOTES_MAX_ALLOWED = 15


def lab_notes(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: [kind] 'text'`` for each lab note in one source file under ``root``."""
    out: list[str] = []
    where = path.relative_to(root).as_posix()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = _LAB_LEFT_OUT.sub(" ", line)
        found = [
            (kind, m.group(0).strip()) for kind, rx in _LAB_NOTES.items() for m in rx.finditer(text)
        ]
        if found and not any(f == where and frag in line for f, frag in LAB_NOTES_ALLOWED):
            out.extend(
                f"{where}:{number}: [{kind}] {what!r} in {line.strip()!r}" for kind, what in found
            )
    return out


def _lab_files() -> list[Path]:
    roots = [ROOT / "offloadd", ROOT / "csrc"]
    return sorted(p for r in roots for p in r.rglob("*") if p.suffix in _LAB_CODE_SUFFIXES)


def test_no_lab_notes_in_the_code() -> None:
    """offloadd/ and csrc/ state rules and reasons; the figures live in docs/benchmarks/."""
    found = [note for path in _lab_files() for note in lab_notes(path)]
    assert found == [], "lab notes in the code (move the figure to a docs/benchmarks/ page):\n" + (
        "\n".join(found)
    )


def test_lab_notes_allowlist_is_short_and_live() -> None:
    """At most 15 constants' justifications stay, and every entry still names a line."""
    assert len(LAB_NOTES_ALLOWED) <= LAB_NOTES_MAX_ALLOWED
    stale = [
        (f, frag)
        for f, frag in LAB_NOTES_ALLOWED
        if frag not in (ROOT / f).read_text(encoding="utf-8")
    ]
    assert stale == [], f"allowlist entries that name no line: {stale}"


def test_the_lab_notes_checker_sees_them(tmp_path: Path) -> None:
    """The checker itself: each kind of lab note is found, and legitimate code is not."""
    notes = [
        "# costs ~0.2 µs a call",
        "# 3.3 -> 6.6 GB/s with 64 MiB requests",
        "# 13-25 % of the step",
        "# ran at 0.93x offloading every block",
        "# about 4x slower than later ones",
        "# import dynamo (1.7 s here)",
        "# measured on 2026-11-23",
        "# the daemon section (eefab01)",
        "# on this project's machine",
        "# on a 2-core VM",
        "# (a review's find)",
    ]
    clean = [
        "x = t / 1e6  # bytes to MB",
        'p.add_argument("--budget", default="0.5x", help="(default 0.5x)")',
        'line = f"{label:32s}{cell:>14s}"',
        '"""Student\'s t, two-sided 95 %, for 1 to 9 degrees of freedom."""',
        "# target <= 3 µs, and <= 1.02 x plain",
        "# a size (6GiB) or a fraction of keep's (0.3x): such as '4MiB'",
        "# see docs/benchmarks/hooks-round2_cpu-2core_2026-12-05.md",
        "RING_RETRIES = 1000  # retried 1 ms apart: at most 5 s",
        "# (1 << 20, 1 MiB by default); 0x7fffffff; 1048576",
    ]
    src = tmp_path / "offloadd" / "m.py"
    src.parent.mkdir()
    src.write_text("\n".join(notes + clean) + "\n", encoding="utf-8")
    found = lab_notes(src, tmp_path)
    lines = sorted({int(f.split(":")[1]) for f in found})
    assert lines == list(range(1, len(notes) + 1)), found


def test_readme_configuration_example_loads(tmp_path: Path) -> None:
    """The README's TOML example is a valid config, and its environment twin gives the same."""
    from offloadd import Config

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    toml = re.search(r"```toml\n(.*?)```", text, re.DOTALL)
    assert toml, "README.md has no TOML example"
    twin = text[text.index("The same in the environment:") :].split("\n\n")[0]
    environ = dict(v.split("=", 1) for v in re.findall(r"`(OFFLOADD_[A-Z_]+=[^`]+)`", twin))
    assert {"OFFLOADD_TIER", "OFFLOADD_BUDGET", "OFFLOADD_DAEMON_QUOTA_BYTES"} <= set(environ)
    path = tmp_path / "my.toml"
    path.write_text(toml.group(1), encoding="utf-8")
    from_file = Config.from_toml(path)
    assert from_file == Config.from_env(environ)
    assert from_file.budget == 0.5 and from_file.daemon.quota_bytes == 64 << 30
    assert from_file.ssd_dirs == ("/mnt/nvme0/offloadd", "/mnt/nvme1/offloadd")


def test_the_checker_sees_broken_links(tmp_path: Path) -> None:
    """The checker itself: a missing file, a missing heading and a link in code."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Daemon mode (`offloadd serve`)\n\n## A, b\n\n## A, b\n\n"
        "[ok](#daemon-mode-offloadd-serve) [ok](#a-b-1) [bad](#a-b-2) [gone](nothing.md) [e]()\n"
        "`[code](nothing.md)`\n\n```\n[fenced](nothing.md)\n```\n"
    )
    assert anchors(page) == {"daemon-mode-offloadd-serve", "a-b", "a-b-1"}
    found = [t for _, t in links(page)]
    assert found == ["#daemon-mode-offloadd-serve", "#a-b-1", "#a-b-2", "nothing.md", ""]
    assert github_slug("Saving less: `memsave`") == "saving-less-memsave"
    assert github_slug("I/O engines, ≥ 0.95 of fio") == "io-engines--095-of-fio"


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page renders, no link or anchor is broken, none leaves
    docs/ (mkdocs is in the test extra; the site goes to a temporary folder)."""
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q"]
    cmd += ["-f", str(ROOT / "mkdocs.yml"), "-d", str(site)]
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}  # material's notice of its successor
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (site / "index.html").is_file() and (site / "budget" / "index.html").is_file()
