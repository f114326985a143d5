"""What moving activations can cost at best on this GPU machine: the bandwidths that bound any
offloader, to set beside ``scripts/bench_compile.py --device cuda``.

    python scripts/gpu_floor.py [--mib 1024] [--dir .]

Prints one JSON line: device-to-host and host-to-device copy bandwidth into pinned and into
pageable host memory (CUDA events, the median of five copies of ``--mib`` MiB after one
untimed), and the disk's sequential O_DIRECT write and read bandwidth (dd, 8 MiB blocks, a file
of the same size in ``--dir``). A step that saves B bytes and offloads them to pinned memory
needs at least 2 B / pinned bandwidth of copy time; to disk, B / write + B / read as well.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess

import torch


def copy_gbps(n: int, pinned: bool, to_host: bool) -> float:
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
    src, dst = (dev, host) if to_host else (host, dev)
    times = []
    for i in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=pinned)
        b.record()
        torch.cuda.synchronize()
        if i:
            times.append(a.elapsed_time(b) / 1e3)
    return n / statistics.median(times) / 1e9


def dd_gbps(args: list[str]) -> float:
    env = {**os.environ, "LC_ALL": "C"}  # dd's summary line in English
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True, env=env).stderr
    m = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", out, re.M)
    assert m, out
    return int(m.group(1)) / float(m.group(2)) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--dir", default=".")
    a = ap.parse_args()
    n = a.mib << 20
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "mib": a.mib}
    for pinned in (True, False):
        for to_host in (True, False):
            key = f"{'d2h' if to_host else 'h2d'}_{'pinned' if pinned else 'pageable'}_gbps"
            res[key] = round(copy_gbps(n, pinned, to_host), 1)
    path = os.path.join(a.dir, "gpu_floor.tmp")
    count = str(max(1, a.mib // 8))
    res["disk_write_odirect_gbps"] = round(
        dd_gbps(["if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "oflag=direct"]), 2
    )
    res["disk_read_odirect_gbps"] = round(
        dd_gbps([f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"]), 2
    )
    os.unlink(path)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
