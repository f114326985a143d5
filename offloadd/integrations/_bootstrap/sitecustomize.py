"""offloadd's bootstrap ``sitecustomize``, found through ``PYTHONPATH`` under ``offloadd run``.

It makes activation independent of ``offloadd.pth`` (an interpreter whose site-packages does not
hold the .pth, offloadd used from a source checkout). It installs the same idempotent start-up
hook, then chains: it takes its own directory off ``sys.path`` and imports the next
``sitecustomize`` on the path, so an existing one (a distribution's, a cluster's) still runs.
``PYTHONPATH`` itself is left alone, so child processes bootstrap the same way.
"""

from __future__ import annotations

import importlib
import os
import sys

__all__: list[str] = []


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    this = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as e:
        if e.name != "sitecustomize":
            raise
        if this is not None:
            sys.modules["sitecustomize"] = this


try:
    import offloadd_boot
except ModuleNotFoundError:  # offloadd_boot sits next to the offloadd package, 3 levels up
    _pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.append(os.path.dirname(_pkg))
    import offloadd_boot

offloadd_boot.install()
_chain()
