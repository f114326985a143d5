"""Local I/O: requests and the engines that serve them, aligned buffers, offload files."""

from offloadd.io.request import Engine, Op, Request, RequestState

__all__ = ["Engine", "Op", "Request", "RequestState"]
