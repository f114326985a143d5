"""Models built into offloadd (no downloads)."""

from offloadd.tools.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
