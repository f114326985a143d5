"""Tests of offloadd/config/: the one configuration and its renamed keys."""
