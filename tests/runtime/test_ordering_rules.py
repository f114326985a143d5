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

import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from offloadd import Offloader
from offloadd.runtime.simulated import SimulatedOrdering
from tests._support.helpers import SavePayload, assert_bitwise_equal, small_offloader, train
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
    rule: str | None,
    request: pytest.FixtureRequest,
    disk_dir: Path,
    scenario: Callable[[SimulatedOrdering, Offloader], list[torch.Tensor]],
    fault: str,
    **config: object,
) -> SimulatedOrdering:
    """Run ``scenario``; with the rule, every payload comes back and nothing is seen; without
    it, the simulated device sees ``fault``."""
    sim = _Without(rule, seed=zlib.crc32(request.node.name.encode()))
    opts: dict[str, object] = {"host_budget_bytes": 16 * _CHUNK, **config}
    off = small_offloader(disk_dir, tier="cpu", ordering=sim, chunk_bytes=_CHUNK, **opts)
    SavePayload.seen.clear()
    try:
        payloads = scenario(sim, off)
        off.synchronize()
        st = off.stats()
        assert st.resident_bytes == 0, st.summary()
    finally:
        off.close()
    assert sim.copies > 0 and sim.memory.allocations > 0
    if rule is None:
        sim.close()
        assert all(any(torch.equal(p, s) for s in SavePayload.seen) for p in payloads), (
            "a payload came back wrong"
        )
    else:
        with pytest.raises(AssertionError, match=fault):
            sim.close()
    return sim


@pytest.mark.parametrize("rule", [None, "upload waits for the consumer"])
def test_an_upload_waits_for_the_kernels_queued_on_its_consumer(
    rule: str | None, request: pytest.FixtureRequest, disk_dir: Path
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

    _check(rule, request, disk_dir, scenario, "read a device buffer that changed", prefetch_bytes=0)


@pytest.mark.parametrize("rule", [None, "hold for the consumer"])
def test_a_block_consumed_on_another_stream_is_held_for_it(
    rule: str | None, request: pytest.FixtureRequest, disk_dir: Path
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

    sim = _check(rule, request, disk_dir, scenario, "read a device buffer that changed")
    assert sim.uploads >= 6, "the first block was not prefetched"


@pytest.mark.parametrize("rule", [None, "hold for the upload"])
def test_a_buffer_dropped_before_its_upload_ran_is_not_reused(
    rule: str | None, request: pytest.FixtureRequest, disk_dir: Path
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
        rule,
        request,
        disk_dir,
        scenario,
        "wrote a device buffer handed out again",
        host_budget_bytes=4 * _CHUNK,
    )


@pytest.mark.parametrize("rule", [None, "copy waits for the producer"])
def test_a_copy_waits_for_the_kernel_that_produced_its_source(
    rule: str | None, request: pytest.FixtureRequest, disk_dir: Path
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

    _check(rule, request, disk_dir, scenario, "had not written yet")


@pytest.mark.parametrize("tier", ["ssd", "cpu"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_lossless_on_a_device_that_runs_everything_late(
    model: str, tier: str, request: pytest.FixtureRequest, disk_dir: Path
) -> None:
    """The equivalence models trained with every op a kernel queued on the compute stream and
    the device's work run as late as it may, buffers reused as soon as the allocator allows:
    gradients bit-identical, and nothing seen."""
    reference = train(*MODELS[model], None)
    sim = SimulatedOrdering(seed=zlib.crc32(request.node.name.encode()), lag_s=_LAG_S)
    off = small_offloader(
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
