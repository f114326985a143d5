"""A real ``offloadd serve`` subprocess for the tests, and ways to count what it holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from offloadd.backend.cmd_status import query
from offloadd.backend.daemon import DaemonError


class DaemonProc:
    """``offloadd serve`` on ``root/run/daemon.sock`` with ``root/data`` as its directory."""

    def __init__(
        self,
        root: Path,
        *args: str,
        dirs: list[Path] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.env = env  # the daemon's whole environment (None: the test's own)
        self.socket = str(root / "run" / "daemon.sock")
        self.dirs = dirs or [root / "data"]
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> DaemonProc:
        cmd = [sys.executable, "-m", "offloadd", "serve", "--socket", self.socket]
        for d in self.dirs:
            cmd += ["--dir", str(d)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd + self.args, stdout=log, stderr=log, env=self.env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log_text()}")
            try:
                self.status()
                return self
            except DaemonError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(query(self.socket).tail)
        return doc

    def wait_idle(self, timeout: float = 5.0) -> dict[str, Any]:
        """The status once no session is left (or the last one seen, after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            doc = self.status()
            if not doc["sessions"] or time.monotonic() > deadline:
                return doc
            time.sleep(0.02)

    def held(self) -> dict[str, int]:
        """Descriptors the daemon holds now: offload files, shared memory."""
        return held_descriptors(self.pid, [str(d) for d in self.dirs])

    def pause(self) -> None:
        """SIGSTOP: the daemon stops answering, its connections stay open (a wedged daemon)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _proc_state(self.pid) not in ("T", "t"):
            assert time.monotonic() < deadline, "the daemon did not stop"
            time.sleep(0.01)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def held_descriptors(pid: int, dirs: list[str]) -> dict[str, int]:
    """Open offload files (in ``dirs``) and memfds of process ``pid``, from /proc."""
    files = 0
    memfds: set[str] = set()  # by name: Python's mmap keeps a duplicate descriptor of its own
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith("/memfd:offloadd"):
            memfds.add(target)
        elif any(target.startswith(d.rstrip("/") + "/") for d in dirs):
            files += 1
    maps = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/memfd:offloadd" in line:
                maps += 1
    return {"files": files, "memfds": len(memfds), "mappings": maps}


class RawSession:
    """A session spoken by hand (no Offloader): for refusals, fuzzing and floods."""

    def __init__(self, socket_path: str, chunk: int = 4096, slots: int = 4) -> None:
        import mmap

        from offloadd.backend.daemon_link import connect_control, recv_frame
        from offloadd.wire import protocol as proto

        self.proto = proto
        self.chunk = chunk
        self.sock = connect_control(socket_path)
        self.sock.sendall(proto.encode_open(1, chunk, slots * chunk, slots * chunk, False))
        fds: list[int] = []
        r = proto.decode_reply(recv_frame(self.sock, bytearray(), fds))
        assert r.status == 0, r.tail
        self.info = json.loads(r.tail)
        self.session = r.value
        self.shm = mmap.mmap(fds[0], self.info["shm_bytes"], flags=mmap.MAP_SHARED)
        for fd in fds:
            os.close(fd)
        self.buf = bytearray()
        self._req = 10

    def call(self, kind: Any, **fields: int) -> Any:
        """Send one request, return its reply."""
        from offloadd.backend.daemon_link import recv_frame

        self._req += 1
        self.sock.sendall(self.proto.encode_request(self.proto.Command(kind, self._req, **fields)))
        r = self.proto.decode_reply(recv_frame(self.sock, self.buf))
        assert r.req == self._req
        return r

    def write(self, data: bytes, slot: int = 0) -> Any:
        off = slot * self.chunk
        self.shm[off : off + len(data)] = data
        return self.call(self.proto.Msg.WRITE, shm_offset=off, nbytes=self.chunk)

    def read(self, block: int, slot: int = 0) -> tuple[Any, bytes]:
        off = self.info["read_offset"] + slot * self.chunk
        r = self.call(self.proto.Msg.READ, block=block, shm_offset=off, nbytes=self.chunk)
        return r, bytes(self.shm[off : off + self.chunk])

    def close(self) -> None:
        self.sock.close()
        self.shm.close()
