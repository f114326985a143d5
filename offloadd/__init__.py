"""offloadd: lossless, asynchronous offloading of saved activations to SSD or host memory."""

from offloadd.config import Config
from offloadd.runtime.offloader import Offloader
from offloadd.runtime.stats import Stats

__all__ = ["Config", "Offloader", "Stats", "__version__"]

__version__ = "0.1.0"
