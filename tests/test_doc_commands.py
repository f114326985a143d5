"""Every command the README and docs/ give to copy still parses: ``offloadd ...`` (and
``python -m offloadd ...``) against the CLI, ``python scripts/NAME.py ...`` and ``python -m
scripts.NAME ...`` against the script's own parser.

A command is taken from a fenced or an indented code block (continuation lines joined, a
prompt's ``$``, env assignments and a trailing comment dropped, ``&&`` and ``;`` split), or from
an inline code span that passes options. Each runs in this process up to its ``parse_args``,
which parses for real and then stops it (:class:`_Parsed`): so a renamed or removed option, a
subcommand gone, a script that no longer parses what the docs say fails here, and nothing is
measured. That the script paths exist is tests/test_scripts.py's; what each tool then does is its
own tests'.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE = re.compile(r"`([^`\n]+)`")
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
_PYTHON = re.compile(r"^(\S*/)?python3?$")
_PLACEHOLDER = re.compile(r"^[A-Z]{3,}$")  # offloadd COMMAND --help


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_lines(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, inline) of each piece of code in a Markdown text: the lines of fenced
    and indented blocks, continuation lines joined, and inline spans."""
    fenced = False
    prev_blank = True
    indented = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            prev_blank = False
            continue
        blank = not line.strip()
        indented = (indented or prev_blank) and line.startswith("    ") and not blank
        if fenced or indented:
            start, joined = pending if pending is not None else (number, "")
            body = line.strip()
            if body.endswith("\\"):
                pending = (start, joined + body[:-1] + " ")
            else:
                pending = None
                yield start, joined + body, False
        else:
            for m in _INLINE.finditer(line):
                yield number, m.group(1), True
        prev_blank = blank


def commands(line: str) -> Iterator[list[str]]:
    """The argv of each command in a line of shell (none where it is not shell)."""
    line = re.sub(r"^\$\s+", "", line)
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:  # not shell (prose in a code span)
        return
    argv: list[str] = []
    for tok in [*tokens, ";"]:
        if tok and set(tok) <= set(";&|"):
            while argv and _ENV.match(argv[0]):
                argv.pop(0)
            if argv[:1] == ["flock"] and len(argv) > 2:  # the machine-wide lock (scripts/README.md)
                argv = argv[2:]
            if argv and not _said(argv):
                # usage's optional parts (``[--plain-shallow]``) are named to be used: kept
                argv = [a.strip("[]") for a in argv]
                argv = [a for a in argv if a not in ("", "...", "…")]  # an elision
                if argv and not any(_PLACEHOLDER.match(a) for a in argv):
                    yield argv
            argv = []
        else:
            argv.append(tok)


def _said(argv: list[str]) -> bool:
    """Whether ``argv`` is a line a command printed (``offloadd doctor: OK``, ``offloadd [rank
    1/2]: ...``), not one to run."""
    return len(argv) > 1 and (
        argv[1].startswith("[") or any(a.endswith(":") or a.startswith("(") for a in argv[1:])
    )


def ours(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """(kind, target, args) for a command of ours: ``cli`` (target unused), ``path`` (a script's
    file) or ``module`` (a script's module); None for anything else."""
    prog = argv[0]
    if prog == "offloadd" or prog.endswith("/bin/offloadd"):
        return "cli", "", argv[1:]
    if _PYTHON.match(prog) and len(argv) > 1:
        if argv[1] == "-m" and len(argv) > 2:
            if argv[2] == "offloadd":
                return "cli", "", argv[3:]
            if argv[2].startswith("scripts."):
                return "module", argv[2], argv[3:]
        elif argv[1].startswith("scripts/") and argv[1].endswith(".py"):
            return "path", argv[1], argv[2:]
    return None


def documented() -> list[tuple[str, list[str], bool]]:
    """(where, argv, inline) of every command of ours the docs give."""
    found: list[tuple[str, list[str], bool]] = []
    for path in doc_files():
        for number, line, inline in code_lines(path.read_text(encoding="utf-8")):
            for argv in commands(line):
                if ours(argv) is None or (inline and not any(a.startswith("--") for a in argv)):
                    continue
                found.append((f"{path.relative_to(ROOT)}:{number}", argv, inline))
    return found


class _Parsed(Exception):
    """Raised by ``parse_args`` once it parsed: the command goes no further."""


@contextlib.contextmanager
def _stop_at_parse() -> Iterator[None]:
    """``parse_args`` parses (options, subcommands, what is left over) and raises
    :class:`_Parsed`; a subcommand's parser runs inside it, through ``parse_known_args``."""
    parse_args = argparse.ArgumentParser.parse_args

    def parsed(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        parse_args(self, *args, **kwargs)
        raise _Parsed

    saved_argv = sys.argv
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", parsed)
        try:
            yield
        finally:
            sys.argv = saved_argv


def parse(argv: list[str], inline: bool = False) -> str | None:
    """None if ``argv`` parses, else what its parser said. ``inline``: a code span in prose,
    which may name an option without its value (``offloadd plan --budget``)."""
    said = _parse(argv)
    if said is not None and inline and "expected one argument" in said:
        said = _parse([*argv, "0"])
    return said


def _parse(argv: list[str]) -> str | None:
    kind, target, args = ours(argv) or ("", "", [])
    args = [re.sub(r"\$\{?\w+\}?", "0", a) for a in args]  # a shell variable (a loop's seed)
    err = io.StringIO()
    with (
        _stop_at_parse(),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            if kind == "cli":
                from offloadd.cli import main

                main(args)
            elif kind == "path":
                sys.argv = [str(ROOT / target), *args]
                runpy.run_path(str(ROOT / target), run_name="__main__")
            else:
                sys.argv = [target, *args]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        except _Parsed:
            return None
        except SystemExit as e:
            return err.getvalue().strip() or f"exited {e.code} before its parser ran"
    return "ran to its end without parsing its arguments"


DOCUMENTED = documented()


def test_the_docs_give_commands_to_check() -> None:
    kinds = {ours(argv)[0] for _, argv, _ in DOCUMENTED}  # type: ignore[index]
    assert kinds == {"cli", "path", "module"}, kinds
    assert len(DOCUMENTED) >= 40


@pytest.mark.parametrize(
    ("argv", "inline"),
    [(a, i) for _, a, i in DOCUMENTED],
    ids=[f"{w} {' '.join(a)[:60]}" for w, a, _ in DOCUMENTED],
)
def test_a_documented_command_parses(
    argv: list[str], inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    said = parse(argv, inline)
    assert said is None, f"`{shlex.join(argv)}` no longer parses:\n{said}"


def test_a_renamed_option_fails() -> None:
    said = parse(["offloadd", "bench", "hooks", "--no-such-option"])
    assert said is not None and "--no-such-option" in said
    assert parse(["offloadd", "bench", "hooks", "--rounds", "3"]) is None
    assert parse(["offloadd", "plan", "--budget"]) is not None
    assert parse(["offloadd", "plan", "--budget"], inline=True) is None  # a span naming it


def test_commands_are_read_from_blocks_spans_and_continuations() -> None:
    text = (
        "Run\n\n"
        "    offloadd bench hooks --relay \\\n"
        "      --rounds 3   # comment\n\n"
        "```sh\n"
        "$ OFFLOADD=1 python -m scripts.codec_error --out x && python train.py\n"
        "```\n"
        "prose `offloadd doctor --json` and `offloadd rok` and offloadd serve\n\n"
        "    offloadd doctor: OK\n"
        "    offloadd bench relay --rounds 3 [--plain-shallow] [--model gpt ...]\n"
        "    offloadd COMMAND --help\n"
        "    flock /work/bench.lock python scripts/relay_wall.py --out y\n"
    )
    found = [
        (n, argv)
        for n, line, inline in code_lines(text)
        for argv in commands(line)
        if ours(argv) and not (inline and not any(a.startswith("--") for a in argv))
    ]
    assert found == [
        (3, ["offloadd", "bench", "hooks", "--relay", "--rounds", "3"]),
        (7, ["python", "-m", "scripts.codec_error", "--out", "x"]),
        (9, ["offloadd", "doctor", "--json"]),
        (12, ["offloadd", "bench", "relay", "--rounds", "3", "--plain-shallow", "--model", "gpt"]),
        (14, ["python", "scripts/relay_wall.py", "--out", "y"]),
    ]
