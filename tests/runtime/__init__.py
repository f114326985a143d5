"""Tests of offloadd/runtime/: the hooks, device ordering, threads, shutdown, the host cache,
torch.compile."""
