"""The training-side runtime: saved-tensor hooks that move activations out and back in time.

See docs/architecture.md for its parts; :mod:`offloadd.runtime.simulated` has the simulated
asynchronous device that tests run the ordering code against.

:class:`Runtime` is one Offloader's machinery; users build ``offloadd.Offloader``, which owns
one and gives it the optional stages (the budget planner, the codec).

The rooms above the runtime (the planner, the codec, relay, the integrations) reach it through
its surface only: ``stages`` (their interfaces), ``identity`` (what a saved tensor is),
``stats``, ``ordering``, and the shared utilities ``compiled.unseen``, ``hook_stack``,
``host_allocator``, ``heap_trim``, ``stall_watch``, ``shutdown``; the rest is its own
(``RUNTIME_SURFACE`` in tests/test_layout.py holds them to it).
"""

from offloadd.runtime.ordering import CudaOrdering, Ordering
from offloadd.runtime.runtime import Runtime
from offloadd.runtime.stats import Stats

__all__ = ["CudaOrdering", "Ordering", "Runtime", "Stats"]
