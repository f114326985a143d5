"""Tests of offloadd/daemon/ (offloadd serve) and its client: faults, restarts, several users,
trust."""
