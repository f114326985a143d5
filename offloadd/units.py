"""Byte counts in words, for messages, tables and logs (``format_bytes``).

Standard library only, at the bottom of the package: the runtime, the planner, the client's
``offloadd status`` and the tools all print sizes the same way.
"""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float) -> str:
    """``n`` bytes as ``"512 B"``, ``"1.5 KiB"``, ``"3.0 MiB"`` or ``"2.0 GiB"`` (GiB at most)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
