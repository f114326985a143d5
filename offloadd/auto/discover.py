"""Which modules of a model are its blocks: the repeated children, found without being told.

The blocks are the children of the ``nn.ModuleList`` or ``nn.Sequential`` anywhere in the model
whose children of one class (at least two) hold the most parameters: the decoder layers of a
transformers model (``transformer.h``, ``model.layers``, ``encoder.layer``), the layers of a
``Sequential``. A model without such a container falls back to its own children that hold
parameters. Blocks are planned in the order the model lists them.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

__all__ = ["find_blocks"]


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def find_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(qualified name, module)]`` of ``root``'s blocks (empty if it has none)."""
    best: tuple[int, int, list[tuple[str, nn.Module]]] | None = None
    for name, m in root.named_modules():
        if not isinstance(m, nn.ModuleList | nn.Sequential):
            continue
        kids = list(m.named_children())
        counts = Counter(type(c) for _, c in kids)
        if not counts:
            continue
        cls, n = counts.most_common(1)[0]
        if n < 2:
            continue
        chosen = [(f"{name}.{k}" if name else k, c) for k, c in kids if type(c) is cls]
        params = sum(_params(c) for _, c in chosen)
        if params == 0:
            continue
        depth = name.count(".") + bool(name)
        if best is None or (params, -depth) > (best[0], -best[1]):
            best = (params, depth, chosen)
    if best is not None:
        return best[2]
    return [(k, c) for k, c in root.named_children() if _params(c) > 0]
