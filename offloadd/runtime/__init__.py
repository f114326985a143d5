"""The training-side runtime: saved-tensor hooks that move activations out and back in time."""

from offloadd.runtime.offloader import Offloader
from offloadd.runtime.stats import Stats

__all__ = ["Offloader", "Stats"]
