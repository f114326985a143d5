"""``offloadd ARGS`` run in the test's own process, for what fails before any work."""

from __future__ import annotations

import contextlib
import io

from offloadd.cli import main

__all__ = ["offloadd_cli"]


def offloadd_cli(*args: str) -> tuple[int, str, str]:
    """``offloadd ARGS`` in this process: (exit status, stdout, stderr), as the command line
    would give them. For argument errors and ``--help``, which fail or answer before any work;
    the end-to-end tests run each command in a process of its own."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # SystemExit(message): the interpreter prints it and exits with 1
                print(e.code, file=err)
                code = 1
    return code, out.getvalue(), err.getvalue()
