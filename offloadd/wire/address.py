"""Where the node's daemon listens: one rule for ``offloadd serve`` and every client.

Note: [the default socket] With no socket given (``daemon.socket`` empty, or ``"default"``),
``offloadd serve`` listens at :func:`default_socket_path`, and ``offloadd status`` and
``offloadd stop`` look there. The training side keeps the embedded engine while
``daemon.socket`` is empty; ``daemon.socket = "default"`` (``OFFLOADD_DAEMON_SOCKET=default``)
has it use the daemon at that same path. Every side resolves the setting through
:func:`socket_path`, so that none spells the path itself (a shell's
``$XDG_RUNTIME_DIR/offloadd/daemon.sock`` is ``/offloadd/daemon.sock`` where the variable is
unset). The path is ``$XDG_RUNTIME_DIR/offloadd/daemon.sock``, else
``/tmp/offloadd-run-$UID/daemon.sock``: the second lies in a directory any local user could
create first, which is why both sides check who owns it before they use it (offloadd/wire/trust.py
[who trusts whom]).

A client that finds no daemon at its path says so in one line (:func:`no_daemon`): the path it
tried, where the default daemon listens, and the command that starts it.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

__all__ = ["DEFAULT", "default_socket_path", "no_daemon", "socket_path"]

DEFAULT = "default"
"""The value of ``daemon.socket`` that names :func:`default_socket_path`."""


def default_socket_path(environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_RUNTIME_DIR/offloadd/daemon.sock``, else ``/tmp/offloadd-run-$UID/daemon.sock``
    (see [the default socket])."""
    env = os.environ if environ is None else environ
    run = env.get("XDG_RUNTIME_DIR")
    base = os.path.join(run, "offloadd") if run else f"/tmp/offloadd-run-{os.getuid()}"
    return os.path.join(base, "daemon.sock")


def socket_path(setting: str, environ: Mapping[str, str] | None = None) -> str:
    """The path ``daemon.socket`` (or ``--socket``) names: the setting itself, or the default
    where it is empty or ``"default"`` (see [the default socket])."""
    if setting in ("", DEFAULT):
        return default_socket_path(environ)
    return setting


def no_daemon(path: str, why: str, environ: Mapping[str, str] | None = None) -> str:
    """One line: no daemon listens at ``path`` (``why``, the error met), where the default
    daemon listens, and how to start one (see [the default socket])."""
    default = default_socket_path(environ)
    if os.path.abspath(path) == os.path.abspath(default):
        return (
            f"no daemon listens at {path!r}, the default socket ({why}); start one with "
            "`offloadd serve`"
        )
    return (
        f"no daemon listens at {path!r} ({why}); the default daemon (`offloadd serve`) listens "
        f'at {default!r}, which daemon.socket = "{DEFAULT}" (OFFLOADD_DAEMON_SOCKET={DEFAULT}) '
        f"names; `offloadd serve --socket {shlex.quote(path)}` would listen at this path"
    )
