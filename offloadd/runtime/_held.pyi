"""Type stub for the C extension built from csrc/hot_path/held.c (offloadd/runtime/held.py
loads it; Note [the tally] there says what it is for)."""

from collections.abc import Callable
from typing import Any

import torch

VERSION: int

class Held:
    """A saved tensor kept as it is (made by ``Tally.keep``)."""

    @property
    def tensor(self) -> torch.Tensor: ...
    @property
    def version(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

class Tally:
    """The count and bytes of saved tensors kept as they are."""

    @property
    def now(self) -> int: ...
    def keep(self, tensor: torch.Tensor, nbytes: int, resident: int, /) -> Held: ...
    def share(self, tensor: torch.Tensor, nbytes: int, /) -> Held: ...
    def take(self) -> tuple[int, int, int, int, int]: ...

class Pack:
    """offloadd's pack hook: small plain tensors kept here, the rest passed to ``slow``."""

    def __init__(
        self,
        tally: Tally,
        min_bytes: int,
        index: Any,
        captures: Any,
        evicted: Any,
        slow: Callable[[torch.Tensor], Any],
        tensor_type: type,
        parameter_type: type,
        strided: torch.layout,
        is_parameter: Callable[[torch.Tensor], bool],
        /,
    ) -> None: ...
    def __call__(self, t: torch.Tensor, /) -> Any: ...
    def __setattr__(self, name: str, value: Any, /) -> None: ...

class Unpack:
    """offloadd's unpack hook: a Held's tensor when unchanged, the rest passed to ``slow``."""

    def __init__(self, slow: Callable[[Any], torch.Tensor], /) -> None: ...
    def __call__(self, packed: Any, /) -> torch.Tensor: ...

class PassPack:
    """relay's pack hook: tensors on no slab passed on (to ``outer``, or kept as they are),
    the rest given to ``slow``."""

    def __init__(
        self,
        slabs: dict[int, Any],
        slow: Callable[[torch.Tensor], Any],
        outer: Callable[[torch.Tensor], Any] | None,
        tensor_type: type,
        parameter_type: type,
        /,
    ) -> None: ...
    def __call__(self, t: torch.Tensor, /) -> Any: ...
    def __setattr__(self, name: str, value: Any, /) -> None: ...

class PassUnpack:
    """relay's unpack hook: its refs given to ``slow``, the rest passed on."""

    def __init__(
        self,
        ref_type: type,
        slow: Callable[[Any], torch.Tensor],
        outer: Callable[[Any], torch.Tensor] | None,
        /,
    ) -> None: ...
    def __call__(self, packed: Any, /) -> torch.Tensor: ...
