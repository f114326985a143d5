#!/usr/bin/env python3
"""Daemon mode against the embedded engine, as ratios measured in one run.

1. Throughput: the same offload workload (large saved tensors written out in forward, read back
   in backward) through the embedded engine and through ``offloadd serve``, on the same
   directory, each in its own client process, interleaved round by round.
2. Two concurrent clients against one: two client processes started together on one daemon,
   their combined throughput against one client alone (interleaved rounds).
3. Control-plane latency: round trips of a request that does no I/O (freeing an unknown block)
   and of 4 KiB writes, against a direct 4 KiB O_DIRECT pwrite in the same process.
4. Checksum cost: hashing speed of xxh3 and crc32 on 4 MiB chunks, and daemon throughput with
   xxh3 against none (interleaved).

Run it under the machine-wide lock:

    flock /work/bench.lock python scripts/bench_daemon.py --dir /tmp/bench-daemon --rounds 5 \\
        --out docs/benchmarks/daemon_cpu-2core_$(date +%F).md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import psutil
import torch

CHUNK = 4 << 20


class _Save(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, payload):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(payload)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (p,) = ctx.saved_tensors
        assert p.numel() > 0
        return g, None


def client(ns: argparse.Namespace) -> int:
    """One client process: write ``--mib`` MiB out in forward, read it back in backward."""
    from offloadd import Offloader

    kw: dict[str, Any] = dict(
        min_bytes=1, chunk_bytes=CHUNK, staging_bytes=128 << 20, prefetch_bytes=128 << 20
    )
    if ns.socket:
        kw["daemon"] = {"socket": ns.socket}
    else:
        kw["ssd_dirs"] = [ns.dir]
    off = Offloader(**kw)
    n = ns.mib // 64
    gen = torch.Generator().manual_seed(0)
    payloads = [
        torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=gen) for _ in range(n)
    ]
    x = torch.ones(1, requires_grad=True)
    # warm-up: files grown, pools faulted in
    with off:
        y = _Save.apply(x, payloads[0])
    off.synchronize()
    y.sum().backward()
    if ns.start_at:
        while time.time() < ns.start_at:
            time.sleep(0.001)
    cpu0 = psutil.Process().cpu_times()
    t0 = time.time()
    with off:
        ys = [_Save.apply(x, p) for p in payloads]
    off.synchronize()
    t1 = time.time()
    sum(y.sum() for y in ys).backward()  # type: ignore[union-attr]
    t2 = time.time()
    cpu1 = psutil.Process().cpu_times()
    st = off.stats()
    off.close()
    print(
        json.dumps(
            {
                "t0": t0,
                "t1": t1,
                "t2": t2,
                "bytes": n * (64 << 20),
                "written": st.bytes_written,
                "read": st.bytes_read,
                "cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
            }
        ),
        flush=True,
    )
    return 0


class Daemon:
    def __init__(self, root: Path, data: str, *args: str) -> None:
        self.socket = str(root / "run" / "daemon.sock")
        cmd = [sys.executable, "-m", "offloadd", "serve", "--socket", self.socket, "--dir", data]
        with open(root / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=log)
        from offloadd.backend.cmd_status import query
        from offloadd.backend.daemon import DaemonError

        for _ in range(600):
            try:
                query(self.socket)
                return
            except DaemonError:
                time.sleep(0.05)
        raise RuntimeError("daemon did not start")

    def cpu_s(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return float(t.user + t.system)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def run_clients(ns: argparse.Namespace, count: int, socket: str | None) -> list[dict[str, Any]]:
    start_at = time.time() + 10.0  # all clients started and warmed up by then (checked below)
    args = [sys.executable, __file__, "--client", "--dir", ns.dir, "--mib", str(ns.mib)]
    args += ["--start-at", str(start_at)]
    if socket:
        args += ["--socket", socket]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"client failed with {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    late = max(r["t0"] for r in out) - start_at
    if late > 0.05:
        print(f"warning: a client started {late:.2f}s late", file=sys.stderr)
    return out


def throughput(results: list[dict[str, Any]]) -> dict[str, float]:
    """Bytes written plus read by all clients over the wall time from first start to last end."""
    total = sum(2 * r["bytes"] for r in results)
    wall = max(r["t2"] for r in results) - min(r["t0"] for r in results)
    w = sum(r["bytes"] for r in results) / (
        max(r["t1"] for r in results) - min(r["t0"] for r in results)
    )
    rd = sum(r["bytes"] for r in results) / (
        max(r["t2"] for r in results) - min(r["t1"] for r in results)
    )
    return {
        "MBps": total / wall / 1e6,
        "write_MBps": w / 1e6,
        "read_MBps": rd / 1e6,
        "client_cpu_s": sum(r["cpu_s"] for r in results),
    }


def latency(socket_path: str, data_dir: str, n: int) -> dict[str, float]:
    import mmap

    from offloadd.backend.daemon_link import connect_control, recv_frame
    from offloadd.io.buffers import AlignedBuffer
    from offloadd.io.files import SlotFile
    from offloadd.wire import protocol as proto

    sock = connect_control(socket_path)
    sock.sendall(proto.encode_open(1, 4096, 4096 * 4, 4096 * 4, False))
    fds: list[int] = []
    r = proto.decode_reply(recv_frame(sock, bytearray(), fds))
    info = json.loads(r.tail)
    shm = mmap.mmap(fds[0], info["shm_bytes"], flags=mmap.MAP_SHARED)
    for fd in fds:
        os.close(fd)
    buf = bytearray()

    def rtt(msg: bytes) -> tuple[float, Any]:
        t0 = time.perf_counter()
        sock.sendall(msg)
        rep = proto.decode_reply(recv_frame(sock, buf))
        return time.perf_counter() - t0, rep

    noop, write, free_ = [], [], []
    for i in range(n):
        dt, _ = rtt(proto.encode_request(proto.Command(proto.Msg.FREE, i + 10, block=2**62)))
        noop.append(dt)
        dt, rep = rtt(
            proto.encode_request(proto.Command(proto.Msg.WRITE, i + 10, shm_offset=0, nbytes=4096))
        )
        write.append(dt)
        dt, _ = rtt(proto.encode_request(proto.Command(proto.Msg.FREE, i + 10, block=rep.block)))
        free_.append(dt)
    sock.close()
    shm.close()
    f = SlotFile(data_dir, 4096, "auto")
    b = AlignedBuffer(4096)
    direct = []
    for _ in range(n):
        t0 = time.perf_counter()
        os.pwrite(f.fd, memoryview(b._mmap), 0)
        direct.append(time.perf_counter() - t0)
    f.close()
    b.close()

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e6

    return {
        "noop_p50_us": q(noop, 0.5),
        "noop_p99_us": q(noop, 0.99),
        "write4k_p50_us": q(write, 0.5),
        "write4k_p99_us": q(write, 0.99),
        "direct4k_p50_us": q(direct, 0.5),
        "direct4k_p99_us": q(direct, 0.99),
    }


def hash_speed() -> dict[str, float]:
    buf = memoryview(os.urandom(CHUNK))
    out = {}
    fns: dict[str, Any] = {"crc32": zlib.crc32}
    try:
        import xxhash

        fns["xxh3"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    for name, fn in fns.items():
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(64):
                fn(buf)
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_GBps"] = 64 * CHUNK / best / 1e9
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket", default=None, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--dir", required=True, help="offload directory (local disk)")
    p.add_argument("--mib", type=int, default=256, help="MiB each client moves (multiple of 64)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--latency-n", type=int, default=2000)
    p.add_argument("--out", default=None, help="write a markdown report here")
    ns = p.parse_args()
    if ns.mib < 64 or ns.mib % 64:
        p.error("--mib must be a positive multiple of 64")
    os.makedirs(ns.dir, exist_ok=True)
    if ns.client:
        return client(ns)

    root = Path(tempfile.mkdtemp(prefix="bench-daemon-"))
    d = Daemon(root, ns.dir)
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in ("embedded", "daemon", "one", "two")}
    daemon_cpu: dict[str, float] = {"daemon": 0.0}
    try:
        for r in range(ns.rounds):
            print(f"round {r + 1}/{ns.rounds}", file=sys.stderr, flush=True)
            # the order alternates from round to round, so drift does not favour either side
            for what in (
                ("embedded", "daemon", "two") if r % 2 == 0 else ("two", "daemon", "embedded")
            ):
                if what == "embedded":
                    rows["embedded"].append(throughput(run_clients(ns, 1, None)))
                elif what == "daemon":
                    c0 = d.cpu_s()
                    rows["daemon"].append(throughput(run_clients(ns, 1, d.socket)))
                    daemon_cpu["daemon"] += d.cpu_s() - c0
                    rows["one"].append(rows["daemon"][-1])
                else:
                    rows["two"].append(throughput(run_clients(ns, 2, d.socket)))
        lat = latency(d.socket, ns.dir, ns.latency_n)
    finally:
        d.stop()
    # checksum: the same daemon workload with checksum none vs xxh3, interleaved
    cks: dict[str, list[float]] = {"xxh3": [], "none": []}
    for _ in range(max(3, ns.rounds // 2 + 1)):
        for kind in ("none", "xxh3"):
            dd = Daemon(root, ns.dir, "--checksum", kind)
            try:
                cks[kind].append(throughput(run_clients(ns, 1, dd.socket))["MBps"])
            finally:
                dd.stop()
    hs = hash_speed()
    shutil.rmtree(root, ignore_errors=True)

    def med(k: str, f: str = "MBps") -> float:
        return statistics.median(x[f] for x in rows[k])

    moved_gb = 2 * ns.mib * (1 << 20) * ns.rounds / 1e9

    def paired(a: str, b: str, f: str = "MBps") -> float:
        """Median over rounds of the ratio of two configurations measured in the same round."""
        return statistics.median(x[f] / y[f] for x, y in zip(rows[a], rows[b], strict=True))

    result = {
        "embedded_MBps": med("embedded"),
        "daemon_MBps": med("daemon"),
        "daemon_vs_embedded": med("daemon") / med("embedded"),
        "daemon_vs_embedded_write": med("daemon", "write_MBps") / med("embedded", "write_MBps"),
        "daemon_vs_embedded_read": med("daemon", "read_MBps") / med("embedded", "read_MBps"),
        "paired_daemon_vs_embedded": paired("daemon", "embedded"),
        "paired_daemon_vs_embedded_write": paired("daemon", "embedded", "write_MBps"),
        "paired_daemon_vs_embedded_read": paired("daemon", "embedded", "read_MBps"),
        "paired_two_vs_one": paired("two", "one"),
        "one_client_MBps": med("one"),
        "two_clients_MBps": med("two"),
        "two_vs_one": med("two") / med("one"),
        "client_cpu_s_per_GB_embedded": sum(x["client_cpu_s"] for x in rows["embedded"]) / moved_gb,
        "client_cpu_s_per_GB_daemon": sum(x["client_cpu_s"] for x in rows["daemon"]) / moved_gb,
        "daemon_cpu_s_per_GB": daemon_cpu["daemon"] / moved_gb,
        **lat,
        "checksum_none_MBps": statistics.median(cks["none"]),
        "checksum_xxh3_MBps": statistics.median(cks["xxh3"]),
        "xxh3_vs_none": statistics.median(cks["xxh3"]) / statistics.median(cks["none"]),
        **hs,
        "raw": {**rows, "checksum": cks},
    }
    print(json.dumps(result, indent=2))
    if ns.out:
        write_report(ns, result)
    return 0


def write_report(ns: argparse.Namespace, r: dict[str, Any]) -> None:
    cmd = " ".join(["flock /work/bench.lock python scripts/bench_daemon.py", *sys.argv[1:]])
    lines = [
        "# Daemon mode vs embedded engine (CPU, 2 cores)",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {platform.node()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, no GPU; offload dir {ns.dir} "
        f"(ext4 on a virtio disk, O_DIRECT); torch {torch.__version__}, Python "
        f"{platform.python_version()}. Other agents' tests may have been running on the same "
        "2 cores during the run (benchmarks themselves were serialised by the lock).",
        "",
        f"Workload per client: {ns.mib} MiB in 64 MiB saved tensors, written in forward "
        "(staging 128 MiB, 4 MiB chunks) and read back in backward, after one warm-up round; "
        "throughput = (bytes written + bytes read) / wall time. "
        f"{ns.rounds} rounds, the configurations interleaved in every round (order reversed "
        "every other round); medians of the figures and of the per-round ratios.",
        "",
        "| figure | value | target |",
        "|---|---|---|",
        f"| embedded throughput (MB/s) | {r['embedded_MBps']:.0f} | |",
        f"| daemon throughput (MB/s) | {r['daemon_MBps']:.0f} | |",
        f"| **daemon / embedded** | **{r['daemon_vs_embedded']:.2f}** | ≥ 0.9 |",
        f"| daemon / embedded, write phase | {r['daemon_vs_embedded_write']:.2f} | |",
        f"| daemon / embedded, read phase | {r['daemon_vs_embedded_read']:.2f} | |",
        f"| daemon / embedded, median of per-round ratios (all, write, read) | "
        f"{r['paired_daemon_vs_embedded']:.2f}, {r['paired_daemon_vs_embedded_write']:.2f}, "
        f"{r['paired_daemon_vs_embedded_read']:.2f} | |",
        f"| one client on the daemon (MB/s) | {r['one_client_MBps']:.0f} | |",
        f"| two concurrent clients, together (MB/s) | {r['two_clients_MBps']:.0f} | |",
        f"| **two clients / one client** | **{r['two_vs_one']:.2f}** | ≥ 0.9 |",
        f"| two / one, median of per-round ratios | {r['paired_two_vs_one']:.2f} | |",
        f"| client CPU-s per GB moved, embedded | {r['client_cpu_s_per_GB_embedded']:.2f} | |",
        f"| client CPU-s per GB moved, daemon mode | {r['client_cpu_s_per_GB_daemon']:.2f} | |",
        f"| daemon CPU-s per GB moved | {r['daemon_cpu_s_per_GB']:.2f} | |",
        f"| control-plane round trip, no I/O, p50 / p99 (µs) | {r['noop_p50_us']:.0f} / {r['noop_p99_us']:.0f} | |",
        f"| 4 KiB write through the daemon, p50 / p99 (µs) | {r['write4k_p50_us']:.0f} / {r['write4k_p99_us']:.0f} | |",
        f"| 4 KiB O_DIRECT pwrite in-process, p50 / p99 (µs) | {r['direct4k_p50_us']:.0f} / {r['direct4k_p99_us']:.0f} | |",
        f"| daemon throughput, checksum none (MB/s) | {r['checksum_none_MBps']:.0f} | |",
        f"| daemon throughput, checksum xxh3 (MB/s) | {r['checksum_xxh3_MBps']:.0f} | |",
        f"| xxh3 / none | {r['xxh3_vs_none']:.2f} | |",
        *(
            f"| hashing speed {k[:-5]} on 4 MiB (GB/s, one core) | {v:.1f} | |"
            for k, v in r.items()
            if k.endswith("_GBps")
        ),
        "",
        "Raw figures (per round):",
        "",
        "```json",
        json.dumps(r["raw"], indent=1),
        "```",
        "",
    ]
    Path(ns.out).write_text("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
