"""The peers offloadd is measured against that change how a run is compiled or scoped, rather
than how its model is built (sac is a build option: models/sac.py).

- ``compile-budget``: the model compiled whole, torch.compile's min-cut partitioner keeping
  ``COMPILE_MEMORY_BUDGET`` of the saved activations (``activation_memory_budget``) and
  recomputing the rest.
- ``compile-offload``: the model compiled whole, with torch.compile's activation offloading
  (``torch._functorch.config.enable_activation_offloading``): inductor moves saved activations
  to host memory on a side stream and back for backward. A GPU's only.
- ``torchtune-offload``: torchtune's ``OffloadActivations``, a saved-tensor-hooks context that
  copies activations to pinned host memory on a CUDA stream. A GPU's only, and only where
  torchtune (and its torchao) installs: ``pip install torchtune torchao``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["COMPILE_MEMORY_BUDGET", "GPU_ONLY", "PEERS", "prepare", "unavailable"]

COMPILE_MEMORY_BUDGET = 0.5
"""compile-budget: ``torch._functorch.config.activation_memory_budget``, the share of the saved
activations torch.compile's min-cut partitioner may keep (the rest recomputed), model compiled
whole; 0.5 is the middle of its range and the value its documentation walks through."""

PEERS = ("compile-budget", "compile-offload", "torchtune-offload")
GPU_ONLY = ("compile-offload", "torchtune-offload")


def unavailable(strategy: str, device: str) -> str | None:
    """Why ``strategy`` cannot run on ``device`` here, or None."""
    if strategy in GPU_ONLY and not device.startswith("cuda"):
        return f"{strategy} offloads to host memory from a GPU: it needs a CUDA device"
    if strategy == "torchtune-offload" and importlib.util.find_spec("torchtune") is None:
        return "torchtune-offload needs torchtune and torchao: pip install torchtune torchao"
    return None


def prepare(strategy: str) -> tuple[bool, Callable[[], AbstractContextManager[Any]]]:
    """Set ``strategy`` up in this process (torch.compile's configuration): whether the model is
    compiled whole, and the context each forward runs in."""
    if strategy in ("compile-budget", "compile-offload"):
        import torch._functorch.config as functorch_config

        if strategy == "compile-budget":
            functorch_config.activation_memory_budget = COMPILE_MEMORY_BUDGET
        else:
            functorch_config.enable_activation_offloading = True
        return True, contextlib.nullcontext
    if strategy == "torchtune-offload":
        why = unavailable(strategy, "cuda")
        if why is not None:
            raise RuntimeError(why)
        from torchtune.training import OffloadActivations

        return False, OffloadActivations
    return False, contextlib.nullcontext
