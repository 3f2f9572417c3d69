"""Look-ahead: each reading process is told its next batches, and their bytes are requested
before the batch that needs them starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import BatchSampler, DataLoader, Dataset, get_worker_info

from tests.conftest import SlideFactory, upload
from wsi_loader.dataset import make_loader
from wsi_loader.dataset._look_ahead import BatchPlan, LookAhead
from wsi_loader.dataset._reading import TileReader
from wsi_loader.index import build_index
from wsi_loader.slides.storage._sources import RangeStore

BATCHES = [[i * 10 + j for j in range(3)] for i in range(10)]


def test_each_batch_names_the_next_batches_of_its_reader() -> None:
    plans = list(LookAhead(BATCHES, streams=2, depth=2))
    assert [p.rows for p in plans] == BATCHES
    assert plans[0].ahead == BATCHES[2] + BATCHES[4]
    assert plans[5].ahead == BATCHES[7] + BATCHES[9]
    assert plans[8].ahead == [] and plans[7].ahead == BATCHES[9]
    assert [p.ahead for p in LookAhead(BATCHES, streams=1, depth=0)] == [[]] * 10
    assert list(LookAhead([], 2, 2)) == []
    with pytest.raises(ValueError, match="streams"):
        LookAhead(BATCHES, streams=0, depth=1)


class Recorder(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, plan: BatchPlan) -> dict[str, Any]:  # type: ignore[override]
        info = get_worker_info()
        return {"worker": info.id if info else -1, "rows": plan.rows, "ahead": plan.ahead}


def test_dataloader_workers_read_the_batches_they_were_told_of() -> None:
    """torch hands batch k to worker k % workers, from worker 0 again at every epoch: what
    a worker is told it reads next is what it reads next."""
    sampler = LookAhead(BatchSampler(range(100), 8, False), streams=2, depth=2)
    loader = DataLoader(
        Recorder(), sampler=sampler, batch_size=None, num_workers=2, persistent_workers=True
    )
    for _ in range(2):  # epochs
        got: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        for item in loader:
            got[item["worker"]].append(item)
        assert len(got[0]) == 7 and len(got[1]) == 6
        for items in got.values():
            for i, item in enumerate(items):
                assert item["ahead"] == [r for later in items[i + 1 : i + 3] for r in later["rows"]]


def test_bytes_of_a_batch_are_requested_before_it_starts(
    s3_endpoint: str, make_slide: SlideFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = upload(make_slide(width=3000, height=2000, seed=7), "s3://slides/lookahead/s.svs")
    index = build_index([url], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0)
    events: list[tuple[str, Any]] = []
    start, read = RangeStore.start, TileReader.read

    def logged_start(self: RangeStore, source: Any, ranges: Any) -> None:
        ranges = list(ranges)
        events.append(("fetch", set(ranges)))
        start(self, source, ranges)

    def logged_read(self: TileReader, rows: Any, *args: Any, **kwargs: Any) -> Any:
        reader = self.get_reader(0)
        windows = [(x, y, lv, s, s) for _, x, y, lv, s in self._windows(np.asarray(rows))]
        wanted = {r for w in windows for r in reader.byte_ranges(w, 256)}  # type: ignore[attr-defined]
        events.append(("batch", wanted))
        return read(self, rows, *args, **kwargs)

    monkeypatch.setattr(RangeStore, "start", logged_start)
    monkeypatch.setattr(TileReader, "read", logged_read)
    loader = make_loader(index, batch_size=8, num_workers=0, seed=1, prefetch=2)
    batches = sum(1 for _ in loader)
    starts = [i for i, (kind, _) in enumerate(events) if kind == "batch"]
    assert len(starts) == batches > 4
    for number, at in enumerate(starts[1:], 1):
        requested = set().union(*(r for kind, r in events[:at] if kind == "fetch"))
        assert events[at][1] <= requested, f"batch {number} waited for bytes nobody asked for"


def test_local_files_get_kernel_read_ahead_for_the_next_batches(
    make_slide: SlideFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cold-page-cache path: the kernel is asked to read the next batches' tiles while
    this batch decodes (posix_fadvise WILLNEED), once the slide is open."""
    import os

    slide = make_slide(width=3000, height=2000, seed=7)
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0)
    advised: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    loader = make_loader(index, batch_size=8, num_workers=0, sampler=list(range(40)))
    batches = list(loader)
    reader = loader.tiles.reader.get_reader(0)  # type: ignore[union-attr]
    last = [
        (x, y, lv, s, s)
        for _, x, y, lv, s in loader.tiles.reader._windows(batches[-1].rows.numpy())
    ]  # type: ignore[union-attr]
    reader._cache.clear()  # type: ignore[attr-defined]
    wanted = [r for w in last for r in reader.byte_ranges(w, 256)]  # type: ignore[attr-defined]
    covered = [any(o <= off and off + n <= o + s for o, s in advised) for off, n in wanted]
    assert wanted and all(covered)


def test_batches_announced_before_their_slide_was_open_are_read_ahead(
    make_slide: SlideFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader's first call names its next batches before it has opened their slide: they
    were marked as announced but never read ahead (the slide was not open yet), so a reading
    process began cold on its first three batches, not one (bench_remote: cold page cache
    0.83x warm, the loss all in the first batches). Every batch after the first is asked of
    the kernel before its tiles are read, and so is the first batch of a reader with
    look-ahead (all its tiles at once, so the kernel reads them concurrently)."""
    import os

    slide = make_slide(width=3000, height=2000, seed=7)
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0)
    events: list[tuple[str, int, int]] = []
    real_advise, real_pread = os.posix_fadvise, os.pread

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            events.append(("advise", offset, length))
        real_advise(fd, offset, length, advice)

    def pread(fd: int, count: int, offset: int) -> bytes:
        events.append(("read", offset, count))
        return real_pread(fd, count, offset)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "pread", pread)
    rows = list(range(48))
    loader = make_loader(index, batch_size=8, num_workers=0, sampler=rows)
    assert sum(len(batch) for batch in loader) == 48
    reads = [i for i, event in enumerate(events) if event[0] == "read"]
    for i in reads:
        _, offset, count = events[i]
        assert any(
            kind == "advise" and o <= offset and offset + count <= o + n
            for kind, o, n in events[:i]
        ), f"tile bytes at {offset} read without being asked for ahead"
    assert len(reads) == 48


def test_read_ahead_opens_only_slides_it_helps_and_evicts_none(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """Look-ahead may open a local slide to ask for its bytes, but not one whose reads cannot
    be asked ahead (OpenSlide's: an NDPI or MRXS open costs tens of ms for nothing), and not
    by closing a slide this process holds (the batch being read may need it)."""
    from wsi_loader.dataset import TileDataset

    slides = [make_slide(width=1500, height=1000, seed=k) for k in (1, 2)]
    for k, slide in enumerate(slides):
        slide.rename(tmp_path / f"s{k}.svs")
    index = build_index(
        [tmp_path / "s0.svs", tmp_path / "s1.svs"], tmp_path / "idx", level=0, min_tissue=0.0
    )
    of = index.columns["slide_id"]
    first, second = np.flatnonzero(of == 0)[:4], np.flatnonzero(of == 1)[:4]

    full = TileDataset(index, max_open_slides=1, record_failures=False)
    full.read_batch(first.tolist())
    held = full.reader.pool.peek(index.slide_path(0), full.reader.backend)
    full.reader.prefetch(second)  # the pool is full: nothing opened, nothing closed
    assert full.reader.pool.peek(index.slide_path(0), full.reader.backend) is held
    assert full.reader.pool.peek(index.slide_path(1), full.reader.backend) is None

    openslide = TileDataset(index, backend="openslide", record_failures=False)
    openslide.reader.prefetch(np.concatenate([first, second]))
    assert len(openslide.reader.pool) == 0

    fresh = TileDataset(index, record_failures=False)
    fresh.reader.prefetch(np.concatenate([first, second]))  # raw-read, room: both opened
    assert len(fresh.reader.pool) == 2
