"""Each rule of [device ordering] that only a late compute stream or a caching allocator can
break, checked by breaking it.

The simulated device runs with ``lag_s``: its work runs as late as anything allows, only when
something waits for it (see offloadd/runtime/simulated.py), so the bad interleaving a missing
rule permits is the one that happens, every run. Each scenario runs as the runtime does it, and
again with the one call that implements its rule dropped by :class:`_Without`; the first must
give the payloads back with no fault, the second must make the simulated device record a fault
(``SimulatedOrdering.close`` raises it).
"""

from __future__ import annotations

import re
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from offloadd import Offloader
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Op, Request
from offloadd.runtime.blocks import Block
from offloadd.runtime.reader import Reader
from offloadd.runtime.simulated import SimulatedOrdering
from tests._support.helpers import MakeOffloader, SavePayload, assert_bitwise_equal, train
from tests.properties.test_equivalence import MODELS

# Engine-independent: the embedded native engine (tests/runtime/test_ordering.py runs every engine).
ENGINE_PARAMS = ("native-threads",)

# Longer than any scenario: work nobody waits for runs at close, after everything else.
_LAG_S = 30.0
_CHUNK = 64 << 10
_TWO_CHUNKS = 2 * _CHUNK // 4  # float32 elements of a block of two chunks


class _Without(SimulatedOrdering):
    """The simulated device with the one call that implements ``rule`` ignored."""

    def __init__(self, rule: str | None, seed: int) -> None:
        super().__init__(seed=seed, max_delay_s=0.0, lag_s=_LAG_S)
        self.rule = rule

    def wait(self, stream: object, event: object) -> None:
        if self.rule == "copy waits for the producer" and stream is self._stream:
            return
        if self.rule == "upload waits for the consumer" and stream is self._upload:
            return
        super().wait(stream, event)  # type: ignore[arg-type]

    def hold(self, tensor: torch.Tensor, stream: object) -> None:
        if self.rule == "hold for the upload" and stream is self._upload:
            return
        if self.rule == "hold for the consumer" and getattr(stream, "host_runs", False):
            return
        super().hold(tensor, stream)


def _pack(off: Offloader, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``n`` blocks of two chunks, each saved by its own graph, copied into their slots."""
    x = torch.ones(4, requires_grad=True)
    payloads = [torch.randn(_TWO_CHUNKS) for _ in range(n)]
    with off:
        outs = [SavePayload.apply(x, p) for p in payloads]
    off.synchronize()
    return payloads, outs


def _check(
    make_offloader: MakeOffloader,
    rule: str | None,
    request: pytest.FixtureRequest,
    disk_dir: Path,
    scenario: Callable[[SimulatedOrdering, Offloader], list[torch.Tensor]],
    fault: str,
    **config: object,
) -> SimulatedOrdering:
    """Run ``scenario``; with the rule, every payload comes back and nothing is seen; without
    it, what the simulated device saw, or the payloads that came back wrong, match ``fault``."""
    sim = _Without(rule, seed=zlib.crc32(request.node.name.encode()))
    opts: dict[str, object] = {"host_budget_bytes": 16 * _CHUNK, **config}
    off = make_offloader(disk_dir, tier="cpu", ordering=sim, chunk_bytes=_CHUNK, **opts)
    SavePayload.seen.clear()
    try:
        payloads = scenario(sim, off)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert sim.copies > 0 and sim.memory.allocations > 0
    saw = []
    try:
        sim.close()
    except AssertionError as e:
        saw.append(str(e))
    wrong = [
        i for i, p in enumerate(payloads) if not any(torch.equal(p, s) for s in SavePayload.seen)
    ]
    if wrong:
        saw.append(f"payloads {wrong} came back wrong")
    if rule is None:
        assert not saw
        assert st.resident_bytes == 0, st.summary()
    else:
        assert re.search(fault, "; ".join(saw)), saw or "nothing was seen"
    return sim


@pytest.mark.parametrize("rule", [None, "upload waits for the consumer"])
def test_an_upload_waits_for_the_kernels_queued_on_its_consumer(
    make_offloader: MakeOffloader, rule: str | None, request: pytest.FixtureRequest, disk_dir: Path
) -> None:
    """H2D: a block copied up from its slots lands in a buffer of the consumer's stream, which
    the caching allocator hands out while kernels queued there may still read it (they read the
    block unpacked before, freed since). The upload stream waits for an event recorded on the
    consumer first; without it the copy overwrites what those kernels read."""

    def scenario(sim: SimulatedOrdering, off: Offloader) -> list[torch.Tensor]:
        payloads, outs = _pack(off, 2)
        with sim.kernels():
            outs[0].sum().backward()  # read by a kernel still queued; freed: its buffer cached
            outs[1].sum().backward()  # copied up into that very buffer
        assert sim.memory.reuses >= 1, "the second block did not reuse the first's buffer"
        return payloads

    _check(
        make_offloader,
        rule,
        request,
        disk_dir,
        scenario,
        "read a device buffer that changed",
        prefetch_bytes=0,
    )


@pytest.mark.parametrize("rule", [None, "hold for the consumer"])
def test_a_block_consumed_on_another_stream_is_held_for_it(
    make_offloader: MakeOffloader, rule: str | None, request: pytest.FixtureRequest, disk_dir: Path
) -> None:
    """H2D: the prefetcher copies a block up into a buffer of the stream it runs on; a backward
    on another stream that reads it marks the buffer used by that stream (record_stream), else
    the allocating stream reuses it while those kernels are still queued."""

    def scenario(sim: SimulatedOrdering, off: Offloader) -> list[torch.Tensor]:
        payloads, outs = _pack(off, 3)
        other = sim.new_stream("other")
        with sim.kernels():
            outs[1].sum().backward()  # prefetches the block of outs[0] onto this stream
        with sim.kernels(other):
            outs[0].sum().backward()  # read there, by a kernel still queued; then freed
        with sim.kernels():
            outs[2].sum().backward()  # copied up on the first stream
        return payloads

    sim = _check(
        make_offloader, rule, request, disk_dir, scenario, "read a device buffer that changed"
    )
    assert sim.uploads >= 6, "the first block was not prefetched"


@pytest.mark.parametrize("rule", [None, "hold for the upload"])
def test_a_buffer_dropped_before_its_upload_ran_is_not_reused(
    make_offloader: MakeOffloader, rule: str | None, request: pytest.FixtureRequest, disk_dir: Path
) -> None:
    """H2D: a block the prefetcher copied up and backward never unpacked is freed while its copy
    is still queued. Its buffer is recorded on the upload stream, else the next allocation of
    the consumer's stream gets it (here the block read back from disk) and the late copy writes
    into it."""

    def scenario(sim: SimulatedOrdering, off: Offloader) -> list[torch.Tensor]:
        payloads, outs = _pack(off, 2)  # spilled to disk when the next two need the slots
        more, outs2 = _pack(off, 2)
        with sim.kernels():
            outs2[1].sum().backward()  # prefetches outs2[0]'s block from its slots
        del outs2[0]  # never unpacked: freed, its copy still queued
        with sim.kernels():
            outs[0].sum().backward()  # read back from disk, copied up on this stream
        st = off.stats()
        assert st.bytes_read > 0 and sim.uploads >= 4, st.summary()
        return [payloads[0], more[1]]

    _check(
        make_offloader,
        rule,
        request,
        disk_dir,
        scenario,
        "wrote a device buffer handed out again",
        host_budget_bytes=4 * _CHUNK,
    )


@pytest.mark.parametrize("rule", [None, "copy waits for the producer"])
def test_a_copy_waits_for_the_kernel_that_produced_its_source(
    make_offloader: MakeOffloader, rule: str | None, request: pytest.FixtureRequest, disk_dir: Path
) -> None:
    """Producer: a saved tensor's kernel is queued on the producer's stream; its copy into a
    slot waits for an event recorded there at capture, else it reads the bytes before the
    kernel wrote them."""

    def scenario(sim: SimulatedOrdering, off: Offloader) -> list[torch.Tensor]:
        x = torch.ones(4, requires_grad=True)
        with sim.kernels():
            with off:
                payload = torch.randn(_TWO_CHUNKS) * 2  # queued, not run, on this stream
                y = SavePayload.apply(x, payload)
            off.synchronize()  # the copy ran
            y.sum().backward()
        return [payload]

    _check(make_offloader, rule, request, disk_dir, scenario, "had not written yet")


@pytest.mark.parametrize("tier", ["ssd", "cpu"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_lossless_on_a_device_that_runs_everything_late(
    make_offloader: MakeOffloader,
    model: str,
    tier: str,
    request: pytest.FixtureRequest,
    disk_dir: Path,
) -> None:
    """The equivalence models trained with every op a kernel queued on the compute stream and
    the device's work run as late as it may, buffers reused as soon as the allocator allows:
    gradients bit-identical, and nothing seen."""
    reference = train(*MODELS[model], None)
    sim = SimulatedOrdering(seed=zlib.crc32(request.node.name.encode()), lag_s=_LAG_S)
    off = make_offloader(
        disk_dir,
        tier=tier,
        ordering=sim,
        chunk_bytes=_CHUNK,
        staging_bytes=4 * _CHUNK,
        host_budget_bytes=4 * _CHUNK,
    )
    try:
        with sim.kernels():
            got = train(*MODELS[model], off)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    sim.close()
    assert_bitwise_equal(reference, got)
    assert st.bytes_read > 0 and sim.memory.reuses > 0, st.summary()
    if tier == "cpu":
        assert sim.uploads > 0, "no block was copied up from its slots"


@pytest.mark.parametrize("rule", [None, "slots held for the upload"])
def test_slots_being_copied_up_are_not_given_back(
    make_offloader: MakeOffloader,
    rule: str | None,
    request: pytest.FixtureRequest,
    disk_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """H2D: a block's slots are given back only once its copy up from them completed
    (Block.upload_pending). The cpu tier's spill skips such a block: the end of its write would
    give the slots back under the copy, a forward would fill them, and the copy would take
    those bytes up instead."""
    if rule is not None:
        monkeypatch.setattr(Block, "upload_pending", lambda self: False)

    def scenario(sim: SimulatedOrdering, off: Offloader) -> list[torch.Tensor]:
        # A block of four chunks, then one of two: the pool of six is full. The spill starts at
        # most four writes, oldest block first: only the first block's, so the slots the forward
        # below gets back are its (with two blocks of two, the forward's own first chunks were
        # written too, and whichever write ended first decided the outcome).
        x = torch.ones(4, requires_grad=True)
        payloads = [torch.randn(2 * _TWO_CHUNKS), torch.randn(_TWO_CHUNKS)]
        with off:
            outs = [SavePayload.apply(x, p) for p in payloads]
        off.synchronize()
        with sim.kernels():
            outs[1].sum().backward()  # prefetches outs[0]'s block: its copy up is queued
        more = torch.randn(2 * _TWO_CHUNKS)  # four chunks, two slots free: the pool spills
        with off:
            y = SavePayload.apply(x, more)
        off.synchronize()  # its copies into the slots ran, then the copy up
        with sim.kernels():
            outs[0].sum().backward()
            y.sum().backward()
        return [payloads[0], more]

    _check(
        make_offloader,
        rule,
        request,
        disk_dir,
        scenario,
        "came back wrong",
        host_budget_bytes=6 * _CHUNK,
    )


def test_a_block_whose_copy_is_still_queued_is_not_read_ahead(
    make_offloader: MakeOffloader, request: pytest.FixtureRequest, disk_dir: Path
) -> None:
    """The prefetcher takes only blocks whose copy into their slots completed: a block packed
    first but captured after a later one (its thread left the scope later) still has its copy
    queued when backward unpacks the later one, which waited for its own copy only."""
    sim = SimulatedOrdering(seed=zlib.crc32(request.node.name.encode()), lag_s=_LAG_S)
    off = make_offloader(
        disk_dir, tier="cpu", ordering=sim, chunk_bytes=_CHUNK, host_budget_bytes=16 * _CHUNK
    )
    x = torch.ones(4, requires_grad=True)
    first, second = torch.randn(_TWO_CHUNKS), torch.randn(_TWO_CHUNKS)
    packed, leave = threading.Event(), threading.Event()
    outs: list[torch.Tensor] = []

    def pack_first() -> None:
        with off:
            outs.append(SavePayload.apply(x, first))
            packed.set()
            leave.wait()  # captured when this scope ends

    SavePayload.seen.clear()
    thread = threading.Thread(target=pack_first)
    thread.start()
    try:
        assert packed.wait(30)
        with off:
            y = SavePayload.apply(x, second)
        leave.set()
        thread.join()
        y.sum().backward()  # reads ahead: the first block is packed before this one
        outs[0].sum().backward()
        off.synchronize()
        st = off.stats()
    finally:
        leave.set()
        off.close()
    sim.close()
    assert torch.equal(SavePayload.seen[0], second) and torch.equal(SavePayload.seen[1], first)
    assert st.resident_bytes == 0, st.summary()


class _GatedEngine(PythonEngine):
    """Writes start at once, so they can no longer be cancelled, then wait for ``gate``."""

    def __init__(self) -> None:
        super().__init__(2)
        self.gate = threading.Event()
        self.started = 0

    def submit(self, request: Request) -> None:
        if request.op is Op.WRITE:
            ready = request.before

            def before() -> None:
                if ready is not None:
                    ready()
                self.started += 1
                self.gate.wait()

            request.before = before
        super().submit(request)


def _wait_for(what: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not what():
        assert time.monotonic() < deadline, "the scenario stalled"
        time.sleep(0.002)


@pytest.mark.parametrize("rule", [None, "no upload under a started write"])
def test_a_block_whose_write_started_is_not_copied_up_from_its_slots(
    make_offloader: MakeOffloader,
    rule: str | None,
    request: pytest.FixtureRequest,
    disk_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """H2D: a block is copied up from its slots only if none of its writes started: the end of
    a write gives its slot back, and another forward may fill it before the copy up reads it.
    Here that forward runs on another thread while the copy up is held back."""
    if rule is not None:

        def slots_to_device(self: Reader, block: Block) -> bool:
            for chunk in block.chunks:
                if chunk.request is not None:
                    self.writer.cancel_write(chunk)
            return self._uploadable(block)

        monkeypatch.setattr(Reader, "_slots_to_device", slots_to_device)
    engine = _GatedEngine()
    sim = _Without(None, seed=zlib.crc32(request.node.name.encode()))
    off = make_offloader(
        disk_dir, ordering=sim, io_engine=engine, chunk_bytes=_CHUNK, prefetch_bytes=0
    )
    upload = sim.upload_stream(torch.device("cpu"))
    held = threading.Event()
    upload.put(held.wait)  # the copy up runs once the other forward is done
    x = torch.ones(4, requires_grad=True)
    first, second = torch.randn(_TWO_CHUNKS), torch.randn(_TWO_CHUNKS)
    unpacked = threading.Event()
    SavePayload.seen.clear()

    def other_forward() -> None:
        try:
            _wait_for(lambda: sim.uploads >= 2 or unpacked.is_set())
            engine.gate.set()  # the first block's writes end: its slots are given back
            _wait_for(lambda: off.stats().bytes_written >= 2 * _CHUNK)
            with sim.kernels(sim.new_stream("other")), off:  # not behind the waiting backward
                z = SavePayload.apply(x, second)  # into those slots
            _wait_for(lambda: off.stats().bytes_written >= 4 * _CHUNK)
            del z
        finally:
            held.set()

    try:
        with off:
            y = SavePayload.apply(x, first)
        _wait_for(lambda: engine.started == 2)  # both writes started
        thread = threading.Thread(target=other_forward)
        thread.start()
        try:
            y.sum().backward()
        finally:
            unpacked.set()
            thread.join()
        off.synchronize()
    finally:
        engine.gate.set()
        held.set()
        off.close()
    sim.close()
    if rule is None:
        assert torch.equal(SavePayload.seen[0], first), "the payload came back wrong"
        assert sim.uploads == 0  # forwarded from its slots instead
    else:
        assert sim.uploads == 2 and not torch.equal(SavePayload.seen[0], first)
