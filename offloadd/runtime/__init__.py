"""The training-side runtime: saved-tensor hooks that move activations out and back in time.

See docs/architecture.md for its parts; :mod:`offloadd.runtime.simulated` has the simulated
asynchronous device that tests run the ordering code against.

:class:`Runtime` is one Offloader's machinery; users build ``offloadd.Offloader``, which owns
one and gives it the optional stages (the budget planner, the codec).
"""

from offloadd.runtime.ordering import CudaOrdering, Ordering
from offloadd.runtime.runtime import Runtime
from offloadd.runtime.stats import Stats

__all__ = ["CudaOrdering", "Ordering", "Runtime", "Stats"]
