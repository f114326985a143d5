"""Tests of offloadd/codec/: the lossy codes and what they must never do."""
