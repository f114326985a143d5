"""A training run's memory peak, predicted without training (``offloadd plan`` without
``--budget``, and the ``predicted_peak_bytes`` column of ``offloadd wall``): the model traced
on fake tensors (live.py, trace.py), the host cache replayed over the trace (hostcache.py), and
the process's own fixed cost measured (peak.py)."""

__all__: list[str] = []
