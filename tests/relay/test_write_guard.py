"""The write guard (csrc/write_guard) among other SIGSEGV handlers, and under threads.

Runtimes that take SIGSEGV as a normal event (a JVM, Julia, wasmtime, Go's c-shared libraries)
install their own handler. The guard must pass every fault that is not a guarded write on to
the handler it displaced and stay installed itself; a fault on a guarded page that a release
made writable meanwhile must be retried, not passed on. Each case runs in its own process (a
crash fails the test rather than ending pytest), against the module itself: no torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offloadd.relay import slabs

pytestmark = [
    pytest.mark.skipif(slabs._write_guard is None, reason="write guard not built"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the runtime"),
]

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for a runtime that uses SIGSEGV as a normal event: it faults on a page of its own
# (PROT_NONE) and recovers, either by making the page accessible and returning (the access is
# retried), or by siglongjmp out of the handler. Any other fault it passes to the handler it
# displaced if asked to chain, else it puts back the default action (the fault then kills).
# Writer threads write into memory given to them until stopped (the stress case).
RUNTIME = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static char *page;
static long size;
static volatile sig_atomic_t caught, jumping, mask_seen;
static int chains;
static struct sigaction before;
static sigjmp_buf back;

static void on_segv(int sig, siginfo_t *info, void *context) {
    char *at = (char *)info->si_addr;
    if (info->si_code > 0 && at >= page && at < page + size) {
        sigset_t now;
        pthread_sigmask(SIG_BLOCK, NULL, &now);
        mask_seen = 2 * sigismember(&now, SIGUSR1) + sigismember(&now, SIGSEGV);
        caught++;
        if (jumping)
            siglongjmp(back, 1);
        mprotect(page, size, PROT_READ | PROT_WRITE);
        return;
    }
    if (chains && (before.sa_flags & SA_SIGINFO))
        before.sa_sigaction(sig, info, context);
    else if (chains && before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN)
        before.sa_handler(sig);
    else
        signal(sig, SIG_DFL);
}

/* Its handler blocks SIGUSR1 while it runs (sa_mask); flags are SA_NODEFER, SA_RESETHAND. */
int runtime_install_as(int chain, int flags) {
    size = sysconf(_SC_PAGESIZE);
    if (page == NULL)
        page = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    chains = chain;
    struct sigaction mine;
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_segv;
    mine.sa_flags = SA_SIGINFO | flags;
    sigemptyset(&mine.sa_mask);
    sigaddset(&mine.sa_mask, SIGUSR1);
    return sigaction(SIGSEGV, &mine, &before);
}

int runtime_install(int chain) {
    return runtime_install_as(chain, 0);
}

/* What its handler saw blocked the last time: 2 for SIGUSR1, plus 1 for SIGSEGV. */
int runtime_mask(void) {
    return mask_seen;
}

/* One fault of its own, recovered: how many it has recovered from so far. */
int runtime_fault(int jump) {
    mprotect(page, size, PROT_NONE);
    jumping = jump;
    if (jump && sigsetjmp(back, 1)) {
        jumping = 0;
        mprotect(page, size, PROT_READ | PROT_WRITE);
        return caught;
    }
    *(volatile char *)page = 1;
    jumping = 0;
    return caught;
}

static char *target;
static long target_bytes;
static atomic_int stop;
static atomic_long writes;
static pthread_t writers[8];
static int nwriters;

static void *write_on(void *arg) {
    long k = (long)arg;
    while (!atomic_load(&stop)) {
        ((volatile char *)target)[(k * 4160) % target_bytes] = (char)k;
        k += 7;
        atomic_fetch_add(&writes, 1);
    }
    return NULL;
}

void writers_start(char *at, long nbytes, int n) {
    target = at;
    target_bytes = nbytes;
    for (nwriters = 0; nwriters < n; nwriters++)
        pthread_create(&writers[nwriters], NULL, write_on, (void *)(long)nwriters);
}

/* Whether SIGSEGV has the default action now (a guard that uninstalled itself left it so). */
int segv_is_default(void) {
    struct sigaction now;
    sigaction(SIGSEGV, NULL, &now);
    return !(now.sa_flags & SA_SIGINFO) && now.sa_handler == SIG_DFL;
}

long writers_stop(void) {
    atomic_store(&stop, 1);
    for (int i = 0; i < nwriters; i++)
        pthread_join(writers[i], NULL);
    return atomic_load(&writes);
}
"""

PRELUDE = """
import ctypes, mmap, sys
from offloadd.relay import _write_guard as guard
rt = ctypes.CDLL(sys.argv[1])
rt.writers_start.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
rt.writers_stop.restype = ctypes.c_long
PAGE = mmap.PAGESIZE

def pages(n):
    mem = mmap.mmap(-1, n * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mem, ctypes.addressof(ctypes.c_char.from_buffer(mem))

def say(*what):
    print(*what, flush=True)
"""

# argv: the runtime, when it installs its handler (before the guard, after it and chaining to
# it, after it alone), whether it recovers by siglongjmp. The guarded writes and the runtime's
# faults interleave inside and outside the guarded window; the last line is a real crash, which
# must still end the process with SIGSEGV (not loop, not be swallowed).
AMONG = (
    PRELUDE
    + """
order, jump = sys.argv[2], int(sys.argv[3])
mem, address = pages(3)
recovered = 0

def runtime_fault():
    global recovered
    recovered += 1
    got = rt.runtime_fault(jump)
    assert got == recovered, (got, recovered)  # its handler ran, each time

if order == "before":
    rt.runtime_install(0)
slot = guard.protect(address, 3 * PAGE)
if order != "before":
    rt.runtime_install(order == "after, chaining")
    runtime_fault()
    guard.release(slot)  # what the runtime does with a guarded write is its own until here:
    slot = guard.protect(address, 3 * PAGE)  # protect puts the guard's handler back on top
for i in range(5):
    runtime_fault()
    runtime_fault()
    mem[PAGE + i] = 7  # a guarded write, caught and let through
    assert guard.fault(slot) == address + PAGE + i, (i, guard.fault(slot))
    runtime_fault()
    assert guard.release(slot) == address + PAGE + i
    assert mem[PAGE + i] == 7
    runtime_fault()  # outside the window
    slot = guard.protect(address, 3 * PAGE)
assert guard.release(slot) == 0
say("survived", recovered)
ctypes.string_at(0)
say("not reached")
"""
)


def run(script: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter (no faulthandler), with the runtime built first."""
    lib = tmp_path / "runtime.so"
    if not lib.exists():
        source = tmp_path / "runtime.c"
        source.write_text(RUNTIME, encoding="utf-8")
        subprocess.run(
            ["cc", "-shared", "-fPIC", "-O1", "-pthread", "-o", str(lib), str(source)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(lib), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize(
    ("order", "jump"),
    [("before", 0), ("before", 1), ("after, chaining", 0), ("after, chaining", 1), ("after", 0)],
)
def test_a_runtime_keeps_its_faults_and_the_guard_its_writes(
    order: str, jump: int, tmp_path: Path
) -> None:
    """The runtime's handler recovers every fault of its own, in and out of the guarded window;
    every guarded write is still the guard's; a real crash still ends the process."""
    out = run(AMONG, order, str(jump), tmp_path=tmp_path)
    recovered = 5 * 4 + (order != "before")
    assert out.stdout.splitlines() == [f"survived {recovered}"], out
    assert out.returncode == -11, out


# argv: the runtime, whether it chains. It installs its handler over the guard's inside a
# guarded window, and a guarded write follows at once (before any protect puts the guard's
# handler back on top).
OVER = (
    PRELUDE
    + """
chains = int(sys.argv[2])
mem, address = pages(1)
slot = guard.protect(address, PAGE)
rt.runtime_install(chains)
say("installed")
mem[9] = 1
say("written", guard.release(slot) == address + 9, mem[9])
"""
)


@pytest.mark.parametrize("chains", [1, 0])
def test_a_runtime_installed_over_the_guard(chains: int, tmp_path: Path) -> None:
    """A handler installed after the guard's sees guarded writes first. One that chains passes
    them to the guard, which catches them; one that does not takes them for its own crash (the
    process ends) until the next protect puts the guard's handler back on top."""
    out = run(OVER, str(chains), tmp_path=tmp_path)
    if chains:
        assert out.stdout.splitlines() == ["installed", "written True 1"], out
        assert out.returncode == 0, out
    else:
        assert out.stdout.splitlines() == ["installed"], out
        assert out.returncode == -11, out


# argv: the runtime. It installs its handler over the guard's again and again, each time with
# other flags (another handler to the guard), and a protect follows each time.
LEVELS = (
    PRELUDE
    + """
NODEFER, RESETHAND, ONSTACK, RESTART = 0x40000000, 0x80000000, 0x08000000, 0x10000000
flags = [0, NODEFER, RESETHAND, ONSTACK, RESTART, NODEFER | RESETHAND, NODEFER | ONSTACK]
flags += [NODEFER | RESTART, RESETHAND | ONSTACK]
mem, address = pages(1)
for i, f in enumerate(flags):
    rt.runtime_install_as(1, f)
    try:
        slot = guard.protect(address, PAGE)
    except RuntimeError as err:
        say(i, err)
    else:
        mem[i] = 1
        assert guard.release(slot) == address + i
"""
)


def test_the_guard_goes_back_on_top_eight_times(tmp_path: Path) -> None:
    """Each protect that finds another handler on top puts the guard's back over it, at a new
    level (chain.c, Note [chaining]); the ninth finds no level left and fails, which relay takes
    as a slab it cannot guard."""
    out = run(LEVELS, tmp_path=tmp_path)
    error = "protect: other SIGSEGV handlers were put over the guard's too often"
    assert out.stdout.splitlines() == [f"8 {error}"], out
    assert out.returncode == 0, out


# argv: the runtime, how its handler is installed (before the guard), whether the guard is.
# What its handler sees of a delivery must not depend on the guard being there.
DELIVERY = (
    PRELUDE
    + """
import os, signal
how, guarded = sys.argv[2], int(sys.argv[3])
SA_NODEFER, SA_RESETHAND = 0x40000000, 0x80000000
if how == "ignored":
    signal.signal(signal.SIGSEGV, signal.SIG_IGN)
else:
    rt.runtime_install_as(0, {"plain": 0, "nodefer": SA_NODEFER, "once": SA_RESETHAND}[how])
mem, address = pages(1)
if guarded:
    slot = guard.protect(address, PAGE)
if how == "ignored":
    os.kill(os.getpid(), signal.SIGSEGV)
    say("a sent signal ignored")
    ctypes.string_at(0)
for i in range(2):
    rt.runtime_fault(0)
    say("recovered, blocked", rt.runtime_mask())
if guarded:
    mem[3] = 1
    say("written", guard.release(slot) == address + 3)
"""
)

DELIVERED = {
    "plain": (["recovered, blocked 3"] * 2, 0),
    "nodefer": (["recovered, blocked 2"] * 2, 0),
    "once": (["recovered, blocked 3"], -11),
    "ignored": (["a sent signal ignored"], -11),
}


@pytest.mark.parametrize("how", list(DELIVERED))
def test_the_guard_delivers_as_the_kernel_would(how: str, tmp_path: Path) -> None:
    """The displaced handler's sa_mask blocked and its signal too unless SA_NODEFER; an
    SA_RESETHAND handler runs once, then the default action kills; with SIG_IGN a signal sent by
    kill is ignored and a fault kills: with and without the guard alike."""
    bare = run(DELIVERY, how, "0", tmp_path=tmp_path)
    lines, rc = DELIVERED[how]
    assert (bare.stdout.splitlines(), bare.returncode) == (lines, rc), bare
    guarded = run(DELIVERY, how, "1", tmp_path=tmp_path)
    if rc == 0:
        lines = [*lines, "written True"]
    assert (guarded.stdout.splitlines(), guarded.returncode) == (lines, rc), guarded


# argv: the runtime, the rounds, the writers. Writer threads write over 16 pages again and
# again while the main thread guards each page and releases it at once, the next page taking the
# slot the last one left. A fault taken just before a release must be retried as a plain write:
# never passed on (the default action ends the process, and a guard that uninstalled itself
# misses the next page's writes) nor recorded against the range that holds its slot next.
STRESS = (
    PRELUDE
    + """
rounds, writers = int(sys.argv[2]), int(sys.argv[3])
held, held_address = pages(4000)  # slots the handler looks through first: a wider window
for i in range(4000):
    guard.protect(held_address + i * PAGE, PAGE)
mem, address = pages(16)
rt.writers_start(address, 16 * PAGE, writers)
starts = [address + i * PAGE for i in range(16)]
seen = 0
for k in range(rounds):
    for start in starts[k % 2 :: 2] + starts[1 - k % 2 :: 2]:
        at = guard.release(guard.protect(start, PAGE))
        assert at == 0 or start <= at < start + PAGE, (hex(start), hex(at))
        seen += at != 0
    assert not rt.segv_is_default(), k  # the guard's handler is still there
writes = rt.writers_stop()
slot = guard.protect(address, 8 * PAGE)
mem[5] = 1
say("survived", seen > 0, writes > 0, guard.release(slot) == address + 5)
"""
)


@pytest.mark.parametrize(
    ("rounds", "writers"), [(1000, 2), pytest.param(5000, 4, marks=pytest.mark.slow)]
)
def test_writes_racing_a_release(rounds: int, writers: int, tmp_path: Path) -> None:
    out = run(STRESS, str(rounds), str(writers), tmp_path=tmp_path)
    assert out.stdout.splitlines() == ["survived True True True"], out
    assert out.returncode == 0, out


# argv: the runtime, the store's directory. The runtime installs its handler before relay and
# faults inside every layer's forward, where the layer's slab is guarded.
RELAYED = (
    PRELUDE
    + """
import torch
import offloadd
from offloadd.config import Config
from offloadd.relay import RelayError
from tests.relay.cases import Layered, freeze_layers

rt.runtime_install(0)
model = offloadd.relay(
    freeze_layers(Layered(d=256)), config=Config().replace(tier="ssd", ssd_dirs=(sys.argv[2],))
)
recovered = 0

def runtime_faults(module, args):
    global recovered
    for _ in range(3):
        recovered += 1
        assert rt.runtime_fault(0) == recovered

for layer in model.layers:
    layer.register_forward_pre_hook(runtime_faults)
x = torch.randn(2, 16)
y = model(x)
handle = model.layers[1][1].register_forward_pre_hook(lambda m, args: m.weight.data.mul_(2))
try:
    model(x)
except RelayError as err:
    say("raised", "layers.1.1.weight" in str(err))
handle.remove()
say("same", torch.equal(model(x), y), recovered >= 2 * 4 * 3)
offloadd.unrelay(model)
"""
)


def test_relay_among_a_runtime(tmp_path: Path, disk_dir: Path) -> None:
    """Relay's check is the guard's: with a runtime faulting inside every guarded window, a
    ``.data`` write in forward still raises naming the weight, and nothing is left changed."""
    out = run(RELAYED, str(disk_dir), tmp_path=tmp_path)
    assert out.stdout.splitlines() == ["raised True", "same True True"], out
    assert out.returncode == 0, out
