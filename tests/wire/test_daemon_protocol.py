"""The wire format on its own: round trips, exact sizes, bounds."""

from __future__ import annotations

import pytest

from offloadd.wire import protocol as proto

pytestmark = pytest.mark.unit


def test_round_trips() -> None:
    hello = proto.decode_request(
        proto.split_frames(bytearray(proto.encode_hello(7, "rank 3")), 512)[0]
    )
    assert hello == proto.Hello(proto.VERSION, 7, "rank 3")
    body = proto.split_frames(bytearray(proto.encode_open(1, 4096, 8192, 4096, True)), 512)[0]
    assert proto.decode_request(body) == proto.Open(1, 4096, 8192, 4096, True)
    for r in (
        proto.Command(proto.Msg.WRITE, 5, shm_offset=4096, nbytes=4096),
        proto.Command(proto.Msg.READ, 6, block=9, shm_offset=0, nbytes=8192),
        proto.Command(proto.Msg.FREE, 7, block=9),
        proto.Command(proto.Msg.STATS, 8),
    ):
        frames = proto.split_frames(bytearray(proto.encode_request(r)), 512)
        assert proto.decode_request(frames[0]) == r
    reply = proto.Reply(3, 0, 11, 1, 4096, 2**64 - 1, 5, b'{"a": 1}')
    assert (
        proto.decode_reply(proto.split_frames(bytearray(proto.encode_reply(reply)), 1 << 20)[0])
        == reply
    )


def test_frames_are_split_only_when_complete() -> None:
    data = proto.encode_request(proto.Command(proto.Msg.STATS, 1)) * 2
    buf = bytearray(data[:-3])
    assert len(proto.split_frames(buf, 512)) == 1 and len(buf) == len(data) // 2 - 3
    buf += data[-3:]
    assert len(proto.split_frames(buf, 512)) == 1 and not buf


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (bytes([99]), "unknown message type"),
        (bytes([proto.Msg.WRITE]) + bytes(23), "must be 24 bytes"),
        (bytes([proto.Msg.WRITE]) + bytes(25), "must be 24 bytes"),
        (bytes([proto.Msg.REPLY]) + bytes(50), "may not send replies"),
        (proto.encode_hello(1, "x")[4:-1], "does not match"),
        (bytes([proto.Msg.HELLO]) + b"XXXX" + bytes(8), "bad magic"),
        (proto.encode_open(1, 4096, 4096, 4096, False)[4:-1] + b"\x02", "attach flag"),
    ],
)
def test_malformed_bodies_are_refused(body: bytes, match: str) -> None:
    with pytest.raises(proto.ProtocolError, match=match):
        proto.decode_request(body)


@pytest.mark.parametrize("length", [0, 513, 2**32 - 1])
def test_frame_length_is_bounded_before_reading(length: int) -> None:
    with pytest.raises(proto.ProtocolError, match="outside"):
        proto.split_frames(bytearray(length.to_bytes(4, "little") + b"x"), 512)
