"""The training-side runtime: saved-tensor hooks that move activations out and back in time.

See docs/architecture.md for its parts; :mod:`offloadd.runtime.simulated` has the simulated
asynchronous device that tests run the ordering code against.

:class:`Offloader` here is the runtime's own, which takes its optional stages (the budget
planner, the codec) as ``stages``; users build ``offloadd.Offloader``, which passes both.
"""

from offloadd.runtime.offloader import Offloader
from offloadd.runtime.ordering import CudaOrdering, Ordering
from offloadd.runtime.stats import Stats

__all__ = ["CudaOrdering", "Offloader", "Ordering", "Stats"]
