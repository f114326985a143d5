"""The measured training run that ``demo``, ``bench`` and ``rok`` share: one run in its own
process (``train``), its memory limit and peak RSS (``memory``), the per-step record and the CPU
allocators a run can use (``step_trace``), and the machine it ran on (``machine``)."""

__all__: list[str] = []
