"""[huge-page buffers]: asking for huge pages keeps a buffer's bytes and never raises."""

from __future__ import annotations

import errno

import pytest
import torch

from offloadd.io import hugepages
from offloadd.io.buffers import AlignedBuffer
from offloadd.io.hugepages import HUGE_PAGE, advise_huge_pages


def test_contents_kept_whatever_the_kernel_says() -> None:
    buf = AlignedBuffer(3 * HUGE_PAGE)
    try:
        src = torch.randint(0, 256, (buf.nbytes,), dtype=torch.uint8, generator=torch.Generator())
        buf.tensor.copy_(src)
        result = advise_huge_pages(buf.address, buf.nbytes)
        assert isinstance(result, bool)
        assert torch.equal(buf.tensor, src)
    finally:
        buf.close()


def test_read_pool_buffers_prefer_huge_pages() -> None:
    """Read buffers of 2 MiB and more advise huge pages before they are faulted; either way
    they come zeroed and whole."""
    from offloadd.io.pools import ReadPool

    pool = ReadPool()
    buf = pool.take(3 * HUGE_PAGE)
    try:
        assert buf.nbytes == 3 * HUGE_PAGE and not buf.tensor.any()
        assert isinstance(hugepages.prefer_huge_pages(buf.address, buf.nbytes), bool)
    finally:
        buf.close()
        pool.close()


def test_no_whole_huge_page_inside() -> None:
    buf = AlignedBuffer(HUGE_PAGE)
    try:
        assert advise_huge_pages(buf.address + 4096, HUGE_PAGE - 8192) is False
    finally:
        buf.close()


@pytest.mark.parametrize("refused", [14, 25])  # MADV_HUGEPAGE, MADV_COLLAPSE
def test_refused_quietly(monkeypatch: pytest.MonkeyPatch, refused: int) -> None:
    calls: list[int] = []

    def fake(address: int, nbytes: int, advice: int) -> int:
        calls.append(advice)
        return errno.EINVAL if advice == refused else 0

    monkeypatch.setattr(hugepages, "_madvise", fake)
    assert advise_huge_pages(HUGE_PAGE, 2 * HUGE_PAGE) is False
    assert calls[-1] == refused


def test_staging_slots_ask_for_huge_pages(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The embedded backend's staging slots (every write's source) ask once, for all of them."""
    from offloadd.backend import embedded
    from offloadd.config import Config
    from offloadd.io.python_engine import PythonEngine

    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(embedded, "advise_huge_pages", lambda a, n: asked.append((a, n)) or False)
    d = tmp_path_factory.mktemp("staging")
    cfg = Config(ssd_dirs=[str(d)], direct_io="off", staging_bytes=8 << 20, chunk_bytes=4 << 20)
    backend = embedded.EmbeddedBackend(cfg, engine=PythonEngine(1))
    try:
        pool = backend.staging()
        assert backend.staging() is pool
        assert asked == [(pool.address(0), 8 << 20)]
    finally:
        backend.close()
