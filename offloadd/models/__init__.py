"""Models built into offloadd (no downloads)."""

from offloadd.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
