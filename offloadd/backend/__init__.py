"""Where the runtime's blocks go: the embedded engine or a node's daemon."""

__all__: list[str] = []
