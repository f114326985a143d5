"""offloadd: lossless, asynchronous offloading of saved activations to SSD or host memory."""

from offloadd.config import OffloadConfig
from offloadd.offloader import Offloader
from offloadd.stats import Stats

__all__ = ["OffloadConfig", "Offloader", "Stats", "__version__"]

__version__ = "0.1.0"
