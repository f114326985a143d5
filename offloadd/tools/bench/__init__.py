"""``offloadd bench``: the command (``command``) and its benchmarks: ``io`` (the I/O engines
against fio: ``io_run``, ``io_engines``, ``io_fio``), ``step`` (keep, recompute, ssd: with
``step_report``) and ``memsave`` (saved bytes with frozen layers)."""

__all__: list[str] = []
