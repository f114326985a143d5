"""Tests of offloadd/memsave/: the layer swaps, their kernels and ops, their config."""
