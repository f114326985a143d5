"""A checkpoint read tensor by tensor, never whole: :class:`Checkpoint` (safetensors).

Note [reading a checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Relay loads a model whose frozen weights may not fit in memory (Note [loading from a
checkpoint] in loading.py), so a checkpoint is never mapped or read whole. Each file's header is
read and checked when the checkpoint is opened: its length, its JSON, each tensor's dtype, shape
and byte range, against the file's size. A short file, a header that does not parse or a range
that does not fit is an error naming the file (and the key) before a byte is written anywhere.
A tensor is then read with ``preadv`` straight into the memory it goes to (a slab's view, a
parameter), or into a temporary one where it is converted (another dtype, strides); the file's
pages just read are dropped from the page cache (``POSIX_FADV_DONTNEED``), so that a memory
limit (a cgroup's, which counts the page cache) sees what relay holds, not the checkpoint.

The formats read are those ``save_pretrained`` writes: one ``.safetensors`` file, or a directory
with its ``*.safetensors.index.json`` (a sharded one) or its one ``model.safetensors``; and a
torch ``.bin`` / ``.pt`` / ``.pth`` state dict (or a directory with its ``*.bin.index.json``),
loaded with ``torch.load(mmap=True, weights_only=True)``: its tensors are views of the mapped
file, read a tensor at a time, never trusted code. Their pages stay mapped until the checkpoint
is closed (clean pages, which a memory limit reclaims, but not dropped behind each read). A file
in torch's legacy format cannot be mapped: it is refused with how to convert it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from offloadd.relay.placeholder import RelayError

__all__ = ["Checkpoint", "CheckpointError", "Stored"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

MAX_HEADER = 100 << 20  # safetensors' own bound on a header's length


class CheckpointError(RelayError):
    """A checkpoint that cannot be read as it says (named by file, and key where there is one)."""


@dataclass(frozen=True)
class Stored:
    """Where one tensor lies: its file, dtype, shape, first byte (from the file's start) and
    length; or, from a torch file, the tensor viewing the mapped file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int
    mapped: torch.Tensor | None = None


class Checkpoint:
    """The tensors of a safetensors checkpoint, by key (see Note [reading a checkpoint])."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tensors: dict[str, Stored] = {}
        self._fds: dict[Path, int] = {}
        try:
            for file, keys in self._files().items():
                if file.suffix in _PICKLED:
                    self._map_pickle(file, keys)
                else:
                    self._read_header(file, keys)
                lost = sorted(k for k in keys or () if k not in self.tensors)
                if lost:
                    raise CheckpointError(
                        f"offloadd relay: the index gives {', '.join(map(repr, lost))} to "
                        f"{str(file)!r}, which does not hold them"
                    )
        except BaseException:
            self.close()
            raise

    def _files(self) -> dict[Path, set[str] | None]:
        """Each file to read, and the keys the index gives it (None: every key it holds)."""
        p = self.path
        if not p.exists():
            raise CheckpointError(f"offloadd relay: checkpoint {str(p)!r} does not exist")
        if p.is_dir():
            for pattern, kind in (("*.safetensors", "safetensors"), ("*.bin", "torch")):
                indexes = sorted(p.glob(pattern + ".index.json"))
                if len(indexes) > 1:
                    names = ", ".join(i.name for i in indexes)
                    raise CheckpointError(
                        f"offloadd relay: checkpoint {str(p)!r} holds several indexes ({names}): "
                        "give the path of the one to read"
                    )
                if indexes:
                    return self._index(indexes[0])
                files = sorted(x for x in p.iterdir() if x.suffix in _SUFFIXES[kind])
                if len(files) == 1:
                    return {files[0]: None}
                if files:
                    raise CheckpointError(
                        f"offloadd relay: checkpoint {str(p)!r} holds {len(files)} {kind} files "
                        f"({', '.join(f.name for f in files)}) and no index saying which key each "
                        "holds: give the path of one, or of its index"
                    )
            raise CheckpointError(
                f"offloadd relay: checkpoint {str(p)!r} holds no .safetensors nor torch "
                "(.bin, .pt, .pth) file"
            )
        if p.name.endswith(".index.json"):
            return self._index(p)
        if p.suffix == ".safetensors" or p.suffix in _PICKLED:
            return {p: None}
        raise CheckpointError(
            f"offloadd relay: checkpoint {str(p)!r} is not a .safetensors or torch (.bin, .pt, "
            ".pth) file, nor an index (*.index.json) of them"
        )

    def _index(self, index: Path) -> dict[Path, set[str] | None]:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"offloadd relay: the index {str(index)!r} cannot be read as a checkpoint "
                f"index ({err!r})"
            ) from err
        files: dict[Path, set[str] | None] = {}
        for key, name in weight_map.items():
            keys = files.setdefault(index.parent / str(name), set())
            assert keys is not None
            keys.add(key)
        return files

    def _read_header(self, file: Path, keys: set[str] | None) -> None:
        try:
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise CheckpointError(f"offloadd relay: cannot open {str(file)!r}: {err}") from err
        self._fds[file] = fd
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
        except OSError as err:  # a directory named like a file, an I/O error
            raise CheckpointError(f"offloadd relay: cannot read {str(file)!r}: {err}") from err
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if length < 2 or length > MAX_HEADER or 8 + length > size:
            raise CheckpointError(
                f"offloadd relay: {str(file)!r} is not a whole safetensors file: its header "
                f"length reads {length} and the file has {size} bytes (a short or damaged file)"
            )
        try:
            header = json.loads(os.pread(fd, length, 8))
            if not isinstance(header, dict):
                raise TypeError("the header is not an object")
        except (ValueError, TypeError, OSError) as err:
            raise CheckpointError(
                f"offloadd relay: the header of {str(file)!r} does not parse ({err}): a damaged file"
            ) from err
        base = 8 + length
        data = size - base
        for key, entry in header.items():
            if key == "__metadata__" or (keys is not None and key not in keys):
                continue
            self.tensors[key] = _stored(file, key, entry, base, data)

    def _map_pickle(self, file: Path, keys: set[str] | None) -> None:
        """A torch state dict, mapped (Note [reading a checkpoint])."""
        try:
            sd = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"offloadd relay: {str(file)!r} cannot be read as a torch state dict without "
                f"loading it whole ({type(err).__name__}: {err})" + _PICKLE_HINT
            ) from err
        if not isinstance(sd, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()
        ):
            raise CheckpointError(
                f"offloadd relay: {str(file)!r} holds a {type(sd).__name__} that is not a state "
                "dict (names to tensors): save model.state_dict() itself"
            )
        for key, t in sd.items():
            if keys is None or key in keys:
                nbytes = t.numel() * t.element_size()
                self.tensors[key] = Stored(file, t.dtype, tuple(t.shape), 0, nbytes, t)

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Read ``key`` into ``out`` (a CPU tensor of its shape, any dtype and strides)."""
        s = self.tensors[key]
        if tuple(out.shape) != s.shape:
            raise CheckpointError(
                f"offloadd relay: {key!r} is {list(s.shape)} in {str(s.file)!r}, the model's "
                f"is {list(out.shape)}"
            )
        if s.mapped is not None:
            try:
                out.copy_(s.mapped)
            except RuntimeError as err:  # a mapped file cut short meanwhile: SIGBUS aside
                raise CheckpointError(
                    f"offloadd relay: reading {key!r} from {str(s.file)!r} failed: {err}"
                ) from err
            return
        if out.dtype == s.dtype and out.is_contiguous():
            self._read(s, key, out)
        else:
            tmp = torch.empty(s.shape, dtype=s.dtype)
            self._read(s, key, tmp)
            out.copy_(tmp)

    def _read(self, s: Stored, key: str, out: torch.Tensor) -> None:
        if not s.nbytes:
            return
        fd = self._fds[s.file]
        view = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        done = 0
        while done < s.nbytes:
            try:
                n = os.preadv(fd, [view[done:]], s.start + done)
            except OSError as err:
                raise CheckpointError(
                    f"offloadd relay: reading {key!r} from {str(s.file)!r} failed: {err}"
                ) from err
            if n == 0:
                raise CheckpointError(
                    f"offloadd relay: {str(s.file)!r} ended while reading {key!r} (byte "
                    f"{s.start + done} of {s.start + s.nbytes}): a short file"
                )
            done += n
        os.posix_fadvise(fd, s.start, s.nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self.tensors = {}  # the mapped tensors with it
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PICKLED = (".bin", ".pt", ".pth")
_SUFFIXES = {"safetensors": (".safetensors",), "torch": _PICKLED}
_PICKLE_HINT = (
    ". Relay reads a torch file mapped (torch.save's zip format, tensors only); convert it "
    "once, e.g. `model.save_pretrained(path, safe_serialization=True)` or "
    "`safetensors.torch.save_file(state_dict, path)`"
)


def _stored(file: Path, key: str, entry: object, base: int, data: int) -> Stored:
    """One header entry, checked against the file's data (``data`` bytes from ``base``)."""
    try:
        assert isinstance(entry, dict)
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
    except (AssertionError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"offloadd relay: the header of {str(file)!r} describes {key!r} as {entry!r}, which "
            f"is not a tensor it can read ({err!r})"
        ) from err
    nbytes = math.prod(shape) * dtype.itemsize
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= data or end - begin != nbytes:
        raise CheckpointError(
            f"offloadd relay: the header of {str(file)!r} puts {key!r} ({entry['dtype']}, "
            f"{list(shape)}: {nbytes} bytes) at bytes [{begin}, {end}) of the {data} after it: "
            "a short or damaged file"
        )
    return Stored(file, dtype, shape, base + begin, nbytes)
