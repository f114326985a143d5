"""The host cache (csrc/host_allocator/, the extension module built by offloadd's install):
installed as torch's CPU allocator in child processes (it is process-wide), bit-identical under
training, and its fallbacks where the module is missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from offloadd import Offloader
from offloadd.runtime import host_allocator
from tests._support.helpers import assert_bitwise_equal, train

BUILT = importlib.util.find_spec(host_allocator.EXTENSION) is not None
needs_built = pytest.mark.skipif(
    not BUILT, reason=f"{host_allocator.EXTENSION} is not built (test_native_install says how)"
)
HIDE = f"import sys; sys.modules[{host_allocator.EXTENSION!r}] = None  # as if not built\n"
"""A child's first line that makes the extension module unimportable."""


def run_child(code: str, *, env: dict[str, str] | None = None) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout, failing with its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@needs_built
def test_loaded_from_the_package() -> None:
    cache = host_allocator.load()
    assert host_allocator.load() is cache
    assert Path(cache.path).parent == Path(host_allocator.__file__).parent
    assert not cache.installed or host_allocator.current() is cache


@needs_built
def test_cache_reuses_warm_blocks_and_caps_what_it_keeps() -> None:
    out = run_child(
        """
        import threading, torch
        from offloadd.runtime import host_allocator as h
        MiB = 1 << 20
        cache = h.acquire()
        cache.install(min_bytes=128 << 10, floor_bytes=0, slack=0.0)
        c0 = cache.counters()

        # Small tensors stay with torch's previous allocator.
        small = torch.empty(1000)
        assert cache.counters().misses == c0.misses

        # A freed block is reused, warm, by the next allocation of its size class.
        a = torch.full((MiB // 4,), 3.0)  # 1 MiB
        ptr = a.data_ptr()
        assert ptr % 4096 == 0
        del a
        b = torch.empty(MiB // 4 - 100)  # same size class
        c1 = cache.counters()
        assert b.data_ptr() == ptr and c1.hits == c0.hits + 1, (c0, c1)
        del b

        # The cap: with slack 0 and no floor, live + cached stays within the live peak, so a miss
        # for a bigger class first unmaps what is cached.
        big = torch.ones(4 * MiB // 4)  # 4 MiB: live peak becomes 4 MiB
        assert big.data_ptr() % (2 * MiB) == 0  # from 2 MiB up: starts on a huge page
        c2 = cache.counters()
        assert c2.cached_bytes == 0 and c2.evicted_bytes >= MiB, c2
        del big
        assert cache.counters().cached_bytes == 4 * MiB
        assert cache.counters().peak_footprint_bytes <= 4 * MiB + (1 << 20)

        # Freed from another thread (as offloadd's I/O callbacks do): cached, then reused.
        box = [torch.zeros(MiB // 2)]
        cached = cache.counters().cached_bytes
        th = threading.Thread(target=box.clear)
        th.start()
        th.join()
        assert cache.counters().cached_bytes == cached + 2 * MiB
        again = torch.empty(MiB // 2)
        assert cache.counters().cached_bytes == cached
        del again

        # Values survive reuse: no stale bytes where torch wrote.
        for n in (300_000, 1_000_000, 300_000):
            x = torch.arange(n, dtype=torch.float32)
            assert torch.equal(x[-3:], torch.tensor([n - 3.0, n - 2.0, n - 1.0]))
            del x

        # Uninstalled: torch's allocator again, cached blocks unmapped, live ones freed later.
        keep = torch.ones(MiB)
        h.release()
        assert h.current() is None and not cache.installed
        assert cache.counters().cached_bytes == 0
        misses = cache.counters().misses
        y = torch.ones(MiB)
        del keep
        c = cache.counters()
        assert c.misses == misses and c.cached_bytes == 0 and c.live_bytes == 0, c
        print("ok")
        """
    )
    assert out.strip() == "ok"


@needs_built
def test_fork_while_another_thread_allocates() -> None:
    """DataLoader workers fork: a child must never inherit the cache's lock held."""
    out = run_child(
        """
        import os, threading, torch
        from offloadd.runtime import host_allocator as h
        h.acquire()
        # The ops' C++ statics are initialized here first: a fork while the churning thread is
        # inside the first torch.ones's static initializer leaves the child waiting on that
        # guard forever (libstdc++'s __cxa_guard_acquire; seen once in ~15 runs, offloadd or
        # not). Small tensors: a parallel region on this thread would leave the child an
        # OpenMP team it cannot use. What this test checks is the cache's own lock.
        torch.ones(10).sum().item()
        stop = False
        def churn():
            while not stop:
                x = torch.ones(300_000); del x
        th = threading.Thread(target=churn); th.start()
        for _ in range(50):
            pid = os.fork()
            if pid == 0:
                x = torch.ones(1_000_000)
                os._exit(0 if x.sum().item() == 1_000_000 else 3)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
        stop = True; th.join()
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_auto_without_the_library_warns_and_caching_raises(disk_dir: Path) -> None:
    out = run_child(
        HIDE
        + f"""
import warnings, pytest
from offloadd import Offloader
from offloadd.runtime.host_allocator import EXTENSION, HostAllocatorError
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    off = Offloader(tier="ssd", ssd_dirs=[{str(disk_dir)!r}])
    off.stats()
    off.close()
assert off.stats().host_allocator == "system"
assert any(EXTENSION in str(x.message) for x in w), [str(x.message) for x in w]
with pytest.raises(HostAllocatorError, match="caching': the extension module " + EXTENSION):
    Offloader(tier="ssd", ssd_dirs=[{str(disk_dir)!r}], host_allocator="caching")
try:
    Offloader(tier="ssd", ssd_dirs=[{str(disk_dir)!r}], host_allocator="caching")
except HostAllocatorError as e:
    assert "pip install --no-build-isolation" in str(e), e  # how to build it
# the demo, bench step and rok then hold glibc's heap equal instead (said on stderr)
from offloadd.tools.harness.step_trace import cpu_allocator
assert cpu_allocator() == "system"
print("ok")
"""
    )
    assert out.strip() == "ok"


def wide_mlp() -> nn.Module:
    # Activations of 1-2 MiB: above the host cache's 128 KiB, so its blocks carry them.
    return nn.Sequential(
        nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 1024), nn.ReLU()
    )


def wide_input(g: torch.Generator) -> torch.Tensor:
    return torch.randn(384, 256, generator=g)


@pytest.mark.parametrize("allocator", ["caching", "system"])
def test_gradients_bit_identical_under_each_allocator(allocator: str, disk_dir: Path) -> None:
    if allocator == "caching" and not BUILT:
        pytest.skip(f"{host_allocator.EXTENSION} is not built (test_native_install says how)")
    reference = train(wide_mlp, wide_input, None, steps=4)
    off = Offloader(
        tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=64 << 10, host_allocator=allocator
    )
    try:
        # settle_first: step 1 reads from disk whatever the timing (its writes may otherwise
        # all still be in staging when backward comes, and be forwarded)
        got = train(wide_mlp, wide_input, off, steps=4, settle_first=True)
        off.synchronize()
        st = off.stats()
        read_buffers = off.runtime.reader.pool.created
    finally:
        off.close()
    assert_bitwise_equal(reference, got)
    assert st.host_allocator == allocator
    assert st.offloaded_bytes > 0 and st.bytes_read > 0
    if allocator == "caching":
        assert st.host_cache_hits > st.host_cache_misses  # steps 2-4 reuse step 1's blocks
        assert host_allocator.current() is None  # released at close: torch's allocator again
        # [one pool]: every record (1.5 MiB) was read back into the host cache's blocks
        assert read_buffers == 0
    else:
        assert read_buffers > 0


@needs_built
def test_host_cache_without_an_offloader() -> None:
    """``offloadd.host_cache()``: plain training on the host cache (no hooks), bit-identical to
    glibc's heap; a tensor made inside outlives the block and is freed by the cache later."""
    out = run_child(
        """
        import torch, offloadd
        from offloadd.runtime import host_allocator

        def train():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                        torch.nn.Linear(1024, 256))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.randn(512, 256)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            return [p.detach().clone() for p in model.parameters()]

        plain = train()
        with offloadd.host_cache() as cache:
            assert host_allocator.current() is cache
            mine = train()
            c = cache.counters()
            kept = torch.ones(1 << 20)  # 4 MiB from the cache, alive after the block
        assert host_allocator.current() is None
        assert c.hits > c.misses, c
        assert all(torch.equal(a, b) for a, b in zip(plain, mine))
        assert kept.sum().item() == 1 << 20
        del kept
        print("ok")
        """
    )
    assert out.strip() == "ok"
