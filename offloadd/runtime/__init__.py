"""The training-side runtime: saved-tensor hooks that move activations out and back in time.

See docs/architecture.md for its parts; :mod:`offloadd.runtime.simulated` has the simulated
asynchronous device that tests run the ordering code against.
"""

from offloadd.runtime.offloader import Offloader
from offloadd.runtime.ordering import CudaOrdering, Ordering
from offloadd.runtime.stats import Stats

__all__ = ["CudaOrdering", "Offloader", "Ordering", "Stats"]
