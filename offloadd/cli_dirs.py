"""The directories named on offloadd's command lines, made ready before a subcommand works.

Note: [directories of the command line]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One rule for every subcommand. An option that names a directory the command writes into
(``--ssd-dir``, ``--dir``, ``rok --out``), or a file it writes (``bench step/memsave --out``,
``--json``, ``run --report``, ``serve --socket``), has that directory (the file's directory)
made ready first, before any work: created if it is missing, as ``mkdir -p`` does, with mode
0700 for each directory created, then probed by creating and removing a file in it. Existing
directories are left as they are, mode included. If the path cannot be made a writable
directory (a file is in the way, no permission, a read-only file system), the command stops
with status 2 and a message naming the option, the path and why. The message comes before any
point is measured, any model is built, any daemon starts or any command runs.

Why create rather than refuse: the defaults are already created (rok's ``./rok``, the daemon's
socket directory, the per-user offload directory), and the daemon creates its socket's
directory 0700. Refusing a missing ``--out`` would only make the user run ``mkdir`` first.
Mode 0700 because offload files hold a run's activations and a socket's directory guards its
daemon. The cost is that a mistyped path, or a drive not mounted where the path expects it,
silently becomes a new directory on another disk. So each directory created is named on
stderr.

This applies to options only. The configuration's directories (``ssd_dirs``,
``OFFLOADD_SSD_DIRS``, the ``[daemon]`` table's ``dirs``) are never created: a missing one
raises when the Offloader is constructed or the daemon starts. ``offloadd status`` and ``stop``
only connect to ``--socket``. A ``run --report`` path whose directory holds ``{rank}`` is left
to each rank's own check at activation.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

__all__ = ["ready_dir", "ready_parent"]


def ready_dir(option: str, path: str | os.PathLike[str]) -> Path:
    """Make ``path`` (given as ``option``) a writable directory, creating what is missing with
    mode 0700; ValueError naming the option, the path and why it cannot be."""
    target = Path(path).expanduser()
    missing = []
    p = target
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                if not d.is_dir():
                    raise
                continue  # made meanwhile by someone else: theirs, mode included
            os.chmod(d, 0o700)  # exactly 0700, whatever the umask
            print(f"offloadd: created {option} directory {str(d)!r} (mode 0700)", file=sys.stderr)
        if not target.is_dir():
            raise NotADirectoryError(f"{str(target)!r} exists and is not a directory")
        with tempfile.TemporaryFile(dir=target, prefix=".offloadd-probe-"):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        if e.filename is not None:
            reason = f"{reason}: {e.filename!r}"
        raise ValueError(f"{option} {str(path)!r} is not a writable directory: {reason}") from None
    return target


def ready_parent(option: str, path: str | os.PathLike[str]) -> Path:
    """:func:`ready_dir` of the directory of the file ``path`` (the current one for a bare name)."""
    return ready_dir(option, Path(path).expanduser().parent)
