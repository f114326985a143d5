"""A seams arm in its own process: ``python -m tests._support.seams.worker SPEC OUT``.

``SPEC``: an :class:`~tests._support.seams.arm.ArmSpec` as JSON; ``OUT``: where the trace goes
(``torch.save``; ``{rank}`` replaced by the rank under torchrun). A refused arm saves
``{"refused": message}``. The process imports offloadd only where the spec names a feature, so
that under ``OFFLOADD=1`` it is an unmodified training script. One intra-op thread, as in the
in-process cells: the same kernels, the same bits.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tests._support.seams.arm import ArmSpec, Refused, run


def main(argv: list[str]) -> int:
    spec = ArmSpec.from_json(json.loads(argv[1]))
    torch.set_num_threads(1)
    try:
        doc = run(spec)
    except Refused as e:
        doc = {"refused": str(e)}
    torch.save(doc, argv[2].format(rank=os.environ.get("RANK", "0")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
