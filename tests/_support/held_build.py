"""A pytest plugin (``-p tests._support.held_build``) that loads the build of
csrc/hot_path/held.c named by ``HELD_TESTS_BUILD`` (a path) as ``offloadd.runtime._held``, in
place of the installed one, before any test imports offloadd: csrc/tests/sanitize.sh runs the
saved-tensor hooks' tests on a sanitized build this way."""

from __future__ import annotations

import importlib.util
import os
import sys

__all__: list[str] = []


def _load(path: str) -> None:
    name = "offloadd.runtime._held"
    if name in sys.modules:
        raise RuntimeError(f"HELD_TESTS_BUILD={path}: {name} was imported before this plugin")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"HELD_TESTS_BUILD={path}: not a module Python can load")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module


if os.environ.get("HELD_TESTS_BUILD"):
    _load(os.environ["HELD_TESTS_BUILD"])
