"""Tests of offloadd/tools/: bench, rok, doctor and the demo."""
