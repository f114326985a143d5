"""The daemon's wire protocol: small, versioned, fixed-layout binary frames.

Every frame is a 4-byte little-endian body length followed by the body; the body starts with a
one-byte message type. Requests from clients have a fixed size per type (the hello carries a
bounded identity string), so a frame is checked against an exact length before any field is read.
Replies carry a fixed header and an optional tail (an error text or a JSON document). A client's
frame decodes to :class:`Hello`, :class:`Open` or :class:`Command`; the daemon's to :class:`Reply`.

Note: [no payload on the socket] Activation bytes never cross the socket: a write names a range
of the session's shared memory (a memfd the daemon created and passed with SCM_RIGHTS), the
daemon writes from it; a read names a range the daemon reads into. Only these descriptors travel.

Conversation: ``HELLO`` (magic, version, pid, identity) -> reply; then either ``STATS`` / ``STOP``
(the ``offloadd status`` / ``offloadd stop`` commands), or ``OPEN`` (one session per connection,
with the session's shared memory and offload files passed back as descriptors), then any number
of ``WRITE`` / ``READ`` / ``FREE`` / ``STATS``, and ``CLOSE``. Every request carries a request id
that its reply echoes; replies may come back in any order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "MAGIC",
    "MAX_FRAME",
    "MAX_IDENTITY",
    "MAX_REPLY",
    "VERSION",
    "Hello",
    "Msg",
    "Open",
    "ProtocolError",
    "Command",
    "Reply",
    "decode_request",
    "encode_hello",
    "encode_open",
    "encode_reply",
    "encode_request",
    "decode_reply",
    "split_frames",
]

MAGIC = b"OFLD"
VERSION = 1
MAX_IDENTITY = 256
#: Largest frame a client may send (the hello with its identity is the largest).
MAX_FRAME = 512
#: Largest frame the daemon sends (a status document).
MAX_REPLY = 1 << 20

_LEN = struct.Struct("<I")


class ProtocolError(ValueError):
    """A malformed, truncated or out-of-bounds message; the connection is dropped."""


class Msg(IntEnum):
    HELLO = 1
    OPEN = 2
    WRITE = 3
    READ = 4
    FREE = 5
    STATS = 6
    CLOSE = 7
    STOP = 8
    REPLY = 0x80


# Body layouts after the type byte.
_HELLO = struct.Struct("<4sHIH")  # magic, version, pid, identity length (+ identity)
_OPEN = struct.Struct("<QQQQB")  # request, chunk_bytes, staging_bytes, read_bytes, attach
_WRITE = struct.Struct("<QQQ")  # request, shm offset, nbytes
_READ = struct.Struct("<QQQQ")  # request, block, shm offset, nbytes
_FREE = struct.Struct("<QQ")  # request, block
_REQ = struct.Struct("<Q")  # request (STATS, CLOSE, STOP)
# request, status (0 or errno), block, file index, file offset, checksum, value (+ tail)
_REPLY = struct.Struct("<QiQHQQQ")

_SIZES = {
    Msg.OPEN: _OPEN.size,
    Msg.WRITE: _WRITE.size,
    Msg.READ: _READ.size,
    Msg.FREE: _FREE.size,
    Msg.STATS: _REQ.size,
    Msg.CLOSE: _REQ.size,
    Msg.STOP: _REQ.size,
}


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    pid: int
    identity: str


@dataclass(frozen=True, slots=True)
class Open:
    req: int
    chunk_bytes: int
    staging_bytes: int
    read_bytes: int
    attach: bool


@dataclass(frozen=True, slots=True)
class Command:
    """A request after the handshake: WRITE, READ, FREE, STATS, CLOSE or STOP; unused fields are 0.

    Not :class:`offloadd.io.request.Request`, the I/O request an engine takes: the daemon turns
    each WRITE and READ command into one of those."""

    kind: Msg
    req: int
    block: int = 0
    shm_offset: int = 0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Reply:
    req: int
    status: int = 0
    block: int = 0
    file: int = 0
    offset: int = 0
    checksum: int = 0
    value: int = 0
    tail: bytes = b""


def _frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


def split_frames(buf: bytearray, limit: int) -> list[bytes]:
    """Remove and return the complete frame bodies at the start of ``buf``.

    A length above ``limit`` or of zero raises :class:`ProtocolError` before anything is read."""
    out = []
    pos = 0
    while len(buf) - pos >= _LEN.size:
        (n,) = _LEN.unpack_from(buf, pos)
        if n == 0 or n > limit:
            raise ProtocolError(f"frame length {n} outside 1..{limit}")
        if len(buf) - pos - _LEN.size < n:
            break
        start = pos + _LEN.size
        out.append(bytes(buf[start : start + n]))
        pos = start + n
    del buf[:pos]
    return out


def encode_hello(pid: int, identity: str, version: int = VERSION) -> bytes:
    ident = identity.encode("utf-8", "replace")[:MAX_IDENTITY]
    return _frame(bytes([Msg.HELLO]) + _HELLO.pack(MAGIC, version, pid, len(ident)) + ident)


def encode_open(
    req: int, chunk_bytes: int, staging_bytes: int, read_bytes: int, attach: bool
) -> bytes:
    return _frame(
        bytes([Msg.OPEN]) + _OPEN.pack(req, chunk_bytes, staging_bytes, read_bytes, int(attach))
    )


def encode_request(r: Command) -> bytes:
    if r.kind is Msg.WRITE:
        body = _WRITE.pack(r.req, r.shm_offset, r.nbytes)
    elif r.kind is Msg.READ:
        body = _READ.pack(r.req, r.block, r.shm_offset, r.nbytes)
    elif r.kind is Msg.FREE:
        body = _FREE.pack(r.req, r.block)
    elif r.kind in (Msg.STATS, Msg.CLOSE, Msg.STOP):
        body = _REQ.pack(r.req)
    else:
        raise ValueError(f"not a request type: {r.kind!r}")
    return _frame(bytes([r.kind]) + body)


def decode_request(body: bytes) -> Hello | Open | Command:
    """Parse one client frame body; anything not exactly well-formed raises ProtocolError."""
    try:
        kind = Msg(body[0])
    except ValueError:
        raise ProtocolError(f"unknown message type {body[0]}") from None
    rest = body[1:]
    if kind is Msg.HELLO:
        if len(rest) < _HELLO.size:
            raise ProtocolError(f"hello of {len(body)} bytes is truncated")
        magic, version, pid, n = _HELLO.unpack_from(rest)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}")
        if n > MAX_IDENTITY or len(rest) != _HELLO.size + n:
            raise ProtocolError(f"hello identity length {n} does not match the frame")
        try:
            ident = rest[_HELLO.size :].decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("hello identity is not UTF-8") from None
        if not ident.isprintable():
            raise ProtocolError("hello identity has control characters")
        return Hello(version, pid, ident)
    if kind is Msg.REPLY:
        raise ProtocolError("a client may not send replies")
    if len(rest) != _SIZES[kind]:
        raise ProtocolError(f"{kind.name} body must be {_SIZES[kind]} bytes, got {len(rest)}")
    if kind is Msg.OPEN:
        req, chunk, staging, read, attach = _OPEN.unpack(rest)
        if attach not in (0, 1):
            raise ProtocolError(f"OPEN attach flag must be 0 or 1, got {attach}")
        return Open(req, chunk, staging, read, bool(attach))
    if kind is Msg.WRITE:
        req, off, n = _WRITE.unpack(rest)
        return Command(kind, req, shm_offset=off, nbytes=n)
    if kind is Msg.READ:
        req, block, off, n = _READ.unpack(rest)
        return Command(kind, req, block=block, shm_offset=off, nbytes=n)
    if kind is Msg.FREE:
        req, block = _FREE.unpack(rest)
        return Command(kind, req, block=block)
    (req,) = _REQ.unpack(rest)
    return Command(kind, req)


def encode_reply(r: Reply) -> bytes:
    head = _REPLY.pack(r.req, r.status, r.block, r.file, r.offset, r.checksum, r.value)
    return _frame(bytes([Msg.REPLY]) + head + r.tail)


def decode_reply(body: bytes) -> Reply:
    if len(body) < 1 + _REPLY.size or body[0] != Msg.REPLY:
        raise ProtocolError(f"malformed reply of {len(body)} bytes")
    req, status, block, file, offset, checksum, value = _REPLY.unpack_from(body, 1)
    return Reply(req, status, block, file, offset, checksum, value, body[1 + _REPLY.size :])
