"""Tests of offloadd/io/: the engines (python, native, GDS), O_DIRECT, huge pages."""
