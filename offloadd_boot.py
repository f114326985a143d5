"""offloadd's start-up hook: switch offloading on from the environment, without importing torch.

Installing offloadd puts ``offloadd.pth`` into site-packages. Its one line runs at every
interpreter start and only looks at ``os.environ``: unless ``OFFLOADD`` or ``OFFLOADD_CONFIG``
is set, this module is not even imported. When one is set, :func:`install` adds an import hook
and returns; nothing else happens until the program imports torch. Right after torch's own
``__init__`` has run, :func:`offloadd.integrations.autoload.activate` validates the environment (a bad
``OFFLOADD_*`` value fails the ``import torch`` with an error naming it) and installs the
module hooks that offload each training forward.

This module must stay cheap and standard-library only: it is imported before the program runs,
and importing the ``offloadd`` package here would import torch.

Note: [idempotent] A ``.pth`` line can run twice (a site directory added twice, a ``site.main()``
re-run), and ``offloadd run`` also calls :func:`install` from a bootstrap ``sitecustomize``. The
module is imported once per interpreter, so its ``_installed`` flag makes every later call a
no-op.
"""

from __future__ import annotations

import os
import sys

# Kept out of start-up: importlib.abc alone pulls in importlib.resources, pathlib and tempfile
# (about 16 ms), and typing about 5 ms. The finder and loader below are duck-typed instead.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

__all__ = ["PTH_LINE", "enabled", "install"]

#: The line of ``offloadd.pth`` (setup.py writes it; tests compare against it).
PTH_LINE = (
    "import os; ('OFFLOADD' in os.environ or 'OFFLOADD_CONFIG' in os.environ) "
    "and __import__('offloadd_boot').install()\n"
)

_OFF = ("", "0", "false", "no", "off")
_installed = False


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for offloading: ``OFFLOADD`` set to anything but an off
    value (``0``, ``false``, ``no``, ``off``), or ``OFFLOADD_CONFIG`` set while ``OFFLOADD`` is
    unset. ``OFFLOADD=0`` wins over a config file. Bad values are rejected at activation."""
    env = os.environ if environ is None else environ
    flag = env.get("OFFLOADD")
    if flag is None:
        return bool(env.get("OFFLOADD_CONFIG"))
    return flag.strip().lower() not in _OFF


def install() -> None:
    """Arrange for offloadd to activate once torch is imported (now, if it already is)."""
    global _installed
    if _installed or not enabled():
        return
    _installed = True
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "nn"):
        _activate()
    else:
        sys.meta_path.insert(0, _TorchWatcher())


def _activate() -> None:
    from offloadd.integrations.autoload import activate

    activate()


class _TorchWatcher:
    """Finds ``torch`` with the other finders and wraps its loader to activate offloadd after."""

    def __init__(self) -> None:
        self._busy = False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname != "torch" or self._busy:
            return None
        self._busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _ActivatingLoader(spec.loader, self)  # type: ignore[assignment]  # duck-typed Loader
        return spec


class _ActivatingLoader:
    """Runs torch's own loader, puts it back in place, then activates offloadd."""

    def __init__(self, loader: Any, watcher: _TorchWatcher) -> None:
        self._loader = loader
        self._watcher = watcher

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        _activate()  # a bad environment raises here, and again at a later ``import torch``
        if self._watcher in sys.meta_path:
            sys.meta_path.remove(self._watcher)

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)
