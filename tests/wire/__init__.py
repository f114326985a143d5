"""Tests of offloadd/wire/: the frames the daemon and its clients exchange."""
