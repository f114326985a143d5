"""Kernels of the simulated device: CPU ops seen as work queued on a compute stream.

A CPU op runs at once on the thread that calls it; on CUDA it would be queued on the current
stream and run later. Under :class:`KernelMode` every op (views and metadata changes aside) is
also told to the simulation, which queues in its place, on the thread's current stream, the
effects the late kernel would have: its reads of device buffers are checked again when the
stream gets there (bytes changed meanwhile are bytes the kernel would have read wrong), and its
outputs count as unwritten until then (a copy on another stream that reads them first reads
bytes the kernel has not written). A kernel that changes a saved tensor in place after its
capture, before its copy ran, is reported that way too: the copy may read either bytes, and
unpack raises for the change anyway (its version counter moved).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["KernelMode"]


class KernelMode(TorchDispatchMode):
    """Calls ``on_kernel(inputs, outputs)`` after each op that reads or writes bytes."""

    def __init__(self, on_kernel: Callable[[list[torch.Tensor], list[torch.Tensor]], None]) -> None:
        super().__init__()
        self._on_kernel = on_kernel

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or torch.Tag.inplace_view in func.tags:
            return out  # no bytes read or written
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self._on_kernel(inputs, outputs)
        return out
