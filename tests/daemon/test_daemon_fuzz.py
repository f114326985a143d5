"""Fuzzing the daemon's protocol against a live daemon (hypothesis).

Each case opens a connection, optionally does a valid handshake (and opens a session), then
sends generated frames: random bytes, frames of valid length with random type and body,
well-formed requests with extreme field values, truncated and over-long valid messages. The
daemon must answer or drop that connection, never hang, crash or leak, while a session opened
before the fuzzing keeps working. ``STOP`` is left out: it is an authorised request by design.

The default run does 1,500 cases; ``-m slow`` runs the full 10,000.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offloadd.wire import protocol as proto
from tests._support.daemon_proc import DaemonProc, RawSession
from tests.conftest import _disk_root

_U64 = st.one_of(
    st.integers(0, 1 << 20), st.sampled_from([0, 1, 4095, 4096, 4097, 2**63, 2**64 - 1])
)
_TYPES = st.integers(0, 255).filter(lambda t: t != proto.Msg.STOP)


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "little") + body


_requests = st.builds(
    lambda kind, req, block, off, n: proto.encode_request(
        proto.Command(kind, req, block=block, shm_offset=off, nbytes=n)
    ),
    st.sampled_from(
        [proto.Msg.WRITE, proto.Msg.READ, proto.Msg.FREE, proto.Msg.STATS, proto.Msg.CLOSE]
    ),
    _U64,
    _U64,
    _U64,
    _U64,
)
_opens = st.builds(
    lambda req, chunk, staging, read, attach: proto.encode_open(req, chunk, staging, read, attach),
    _U64,
    st.one_of(_U64, st.just(4096)),
    _U64,
    _U64,
    st.booleans(),
)
_hellos = st.builds(
    lambda version, pid, ident: proto.encode_hello(pid, ident, version=version),
    st.integers(0, 65535),
    st.integers(0, 2**32 - 1),
    st.text(max_size=40),
)
_valid = st.one_of(_requests, _opens, _hellos)
_messages = st.one_of(
    st.binary(max_size=600),
    st.builds(lambda t, body: _frame(bytes([t]) + body), _TYPES, st.binary(max_size=64)),
    _valid,
    st.builds(lambda m, cut: m[: max(1, len(m) - cut)], _valid, st.integers(1, 30)),
    st.builds(lambda m, extra: _frame(m[4:] + extra), _valid, st.binary(min_size=1, max_size=16)),
)
_cases = st.tuples(st.integers(0, 2), st.lists(_messages, min_size=1, max_size=6))


@pytest.fixture(scope="module")
def fuzz_daemon() -> Iterator[DaemonProc]:
    root = Path(tempfile.mkdtemp(prefix="offloadd-fuzz-", dir=_disk_root()))
    cfg = root / "fuzz.toml"
    cfg.write_text('max_shm_bytes = "1MiB"\nmax_chunk_bytes = "64KiB"\nquota_bytes = "1MiB"\n')
    d = DaemonProc(root, "--config", str(cfg)).start()
    yield d
    assert d.stop() == 0, d.log_text()[-2000:]
    assert not list(d.dirs[0].iterdir())
    import shutil

    shutil.rmtree(root)


def _run_case(d: DaemonProc, prefix: int, messages: list[bytes]) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    s.connect(d.socket)
    head = b""
    if prefix >= 1:
        head += proto.encode_hello(os.getpid(), "fuzz")
    if prefix >= 2:
        head += proto.encode_open(1, 4096, 16384, 16384, False)
    try:
        s.sendall(head + b"".join(messages))
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):  # until the daemon closes: it never hangs on a connection
            pass
    except (BrokenPipeError, ConnectionResetError):
        pass  # dropped while we were still sending: fine
    finally:
        s.close()


def _fuzz(d: DaemonProc, n: int) -> None:
    keep = RawSession(d.socket)
    data = os.urandom(4096)
    block = keep.write(data).block
    count = [0]

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_cases)
    def case(c: tuple[int, list[bytes]]) -> None:
        _run_case(d, c[0], c[1])
        count[0] += 1
        if count[0] % 250 == 0:  # the daemon and the other session keep working
            r, got = keep.read(block)
            assert r.status == 0 and got == data

    t0 = time.monotonic()
    case()
    assert d.proc is not None and d.proc.poll() is None
    r, got = keep.read(block)
    assert r.status == 0 and got == data
    doc = d.wait_idle(timeout=0.1)
    deadline = time.monotonic() + 5
    while len(doc["sessions"]) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        doc = d.status()
    assert [s["id"] for s in doc["sessions"]] == [keep.session]  # fuzz sessions all ended
    assert d.held() == {"files": 1, "memfds": 1, "mappings": 1}  # only the kept session's
    assert doc["dropped_connections"] > 0
    keep.close()
    print(f"{count[0]} fuzz cases in {time.monotonic() - t0:.1f}s")


def test_fuzz_protocol(fuzz_daemon: DaemonProc) -> None:
    _fuzz(fuzz_daemon, 1500)


@pytest.mark.slow
def test_fuzz_protocol_10k(fuzz_daemon: DaemonProc) -> None:
    _fuzz(fuzz_daemon, 10_000)
