"""Tests of offloadd/integrations/: OFFLOADD=1, its scope rule, and real training clients under it."""
