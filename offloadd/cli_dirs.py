"""The directories named on offloadd's command lines, made ready before a subcommand works.

Note: [directories of the command line]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One rule for every subcommand. An option that names a directory the command writes into
(``--ssd-dir``, ``--dir``, ``rok --out``), or a file it writes (``bench step/memsave --out``,
``--json``, ``run --report``, ``serve --socket``), has that directory (the file's directory)
made ready first, before any work: created if it is missing, as ``mkdir -p -m 0700`` does
(the directory itself 0700, any missing one above it with the umask's mode, so that a daemon's
``allowed_uids`` can still pass through to its socket), then probed by creating and removing a
file in it. Existing directories are left as they are, mode included (the daemon then sets its
socket's directory as its Note [socket modes] says). If the path cannot be made a writable
directory (a file is in the way, no permission, a read-only file system), the command stops
with status 2 and a message naming the option, the path and why. The message comes before any
point is measured, any model is built, any daemon starts or any command runs.

Why create rather than refuse: the defaults are already created (rok's ``./rok``, the daemon's
socket directory, the per-user offload directory). Refusing a missing ``--out`` would only make the user run ``mkdir`` first.
Mode 0700 because offload files hold a run's activations and a socket's directory guards its
daemon. The cost is that a mistyped path, or a drive not mounted where the path expects it,
silently becomes a new directory on another disk. So each directory created is named on
stderr.

This applies to options only. The configuration's directories (``ssd_dirs``,
``OFFLOADD_SSD_DIRS``, the ``[daemon]`` table's ``dirs``) are never created: a missing one
raises when the Offloader is constructed or the daemon starts. ``offloadd status`` and ``stop``
only connect to ``--socket``. A ``run --report`` path whose directory holds ``{rank}`` is left
to each rank's own check at activation. ``offloadd doctor --ssd-dir`` and ``--socket`` are
examined, never made: a missing directory is what the doctor is there to report.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

__all__ = ["ready_dir", "ready_parent"]


def ready_dir(option: str, path: str | os.PathLike[str]) -> Path:
    """Make ``path`` (given as ``option``) a writable directory, creating what is missing as
    ``mkdir -p -m 0700`` does; ValueError naming the option, the path and why it cannot be."""
    target = Path(path).expanduser()
    missing = []
    p = target
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        for d in reversed(missing):
            leaf = d == target
            try:
                os.mkdir(d, 0o700 if leaf else 0o777)  # those above: the umask's, as mkdir -p
            except FileExistsError:
                if not d.is_dir():
                    raise
                continue  # made meanwhile by someone else: theirs, mode included
            if leaf:
                os.chmod(d, 0o700)  # exactly 0700, whatever the umask
            mode = oct(stat.S_IMODE(d.stat().st_mode))[2:].zfill(4)
            print(f"offloadd: created {option} directory {str(d)!r} (mode {mode})", file=sys.stderr)
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
