from __future__ import annotations

import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openslide
import pytest

from tests.conftest import CORRUPT, corrupt_rows
from wsi_loader.dataset import TileReader
from wsi_loader.dataset import _reading as reading
from wsi_loader.dataset._cores import FreeCores, usable_cores
from wsi_loader.device._bench import busy_cores
from wsi_loader.errors import TileReadError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.slides import _base as base
from wsi_loader.slides import _pool as pool_module
from wsi_loader.slides._base import SlideReader, supports
from wsi_loader.slides._open import open_slide
from wsi_loader.slides._pool import HandlePool
from wsi_loader.slides._tiff import TiffReader


def openslide_pixels(index: SlideIndex, row: int) -> np.ndarray:
    cols = index.columns
    slide = openslide.OpenSlide(index.slide_path(int(cols["slide_id"][row])))
    size = int(cols["read_size"][row])
    region = slide.read_region(
        (int(cols["l0_x"][row]), int(cols["l0_y"][row])), int(cols["level"][row]), (size, size)
    )
    slide.close()
    return np.asarray(region)[..., :3]


def test_good_tiles_match_openslide_and_bad_ones_are_filled(index: SlideIndex) -> None:
    bad = corrupt_rows(index)
    assert len(bad) == 4
    neighbours = np.concatenate([bad - 1, bad + 1, [0, len(index) - 1]])
    neighbours = np.setdiff1d(neighbours, bad)
    reader = TileReader(index, on_error="fill", fill_value=7)
    result = reader.read(np.concatenate([bad, neighbours]))
    assert result.ok.tolist() == [False] * 4 + [True] * len(neighbours)
    assert (result.pixels[:4] == 7).all()
    assert all("marker" in (e or "") for e in result.errors[:4])
    for i, row in enumerate(neighbours.tolist(), start=4):
        np.testing.assert_array_equal(result.pixels[i], openslide_pixels(index, row))
    records = index.quarantine.read()
    assert sorted(r["row"] for r in records) == sorted(bad.tolist())
    assert {"slide_id", "x", "y", "error", "path"} <= records[0].keys()


def test_retries_are_bounded_and_reopen(index: SlideIndex) -> None:
    row = int(corrupt_rows(index)[0])
    reader = TileReader(index, retries=3, record_failures=False)
    before = reader.pool.opened
    assert not reader.read([row]).ok[0]
    assert reader.pool.opened - before == 4  # first try + 3 retries, each on a fresh handle
    good = int(np.setdiff1d(np.arange(len(index)), corrupt_rows(index))[-1])
    assert reader.read([good]).ok[0]


def test_substitute_reads_a_deterministic_tile_of_the_same_slide(index: SlideIndex) -> None:
    row = int(corrupt_rows(index)[0])
    reader = TileReader(index, on_error="substitute", record_failures=False)
    first = reader.read([row])
    again = TileReader(index, on_error="substitute", record_failures=False).read([row])
    assert not first.ok[0] and first.substituted[0]
    source = int(first.source_rows[0])
    assert source != row and source == int(again.source_rows[0])
    assert index.columns["slide_id"][source] == index.columns["slide_id"][row]
    np.testing.assert_array_equal(first.pixels[0], openslide_pixels(index, source))


def test_raise_policy_raises_structured_error(index: SlideIndex) -> None:
    row = int(corrupt_rows(index)[0])
    with pytest.raises(TileReadError) as info:
        TileReader(index, on_error="raise", retries=0).read([row])
    err = info.value
    assert err.path and err.path.endswith("bad.svs")
    assert (err.l0_x, err.l0_y, err.level) == (
        int(index.columns["l0_x"][row]),
        int(index.columns["l0_y"][row]),
        0,
    )
    assert "marker" in (err.cause or "")
    assert index.quarantine.read()[0]["row"] == row  # recorded before raising


def test_vanished_and_truncated_slides_are_failures(index: SlideIndex, archive: Path) -> None:
    good_id = next(i for i, s in enumerate(index.slides) if s.path.endswith("good.svs"))
    bad_id = 1 - good_id
    rows_good = np.flatnonzero(index.columns["slide_id"] == good_id)[:3]
    rows_bad = np.flatnonzero(index.columns["slide_id"] == bad_id)[:2]
    reader = TileReader(index, retries=1)
    assert reader.read(rows_good).ok.all()
    os.remove(archive / "good.svs")  # deleted mid-epoch
    with open(archive / "bad.svs", "r+b") as fh:  # truncated mid-epoch
        fh.truncate(4096)
    reader.pool.close()
    result = reader.read(np.concatenate([rows_good, rows_bad]))
    assert not result.ok.any()
    assert "does not exist" in (result.errors[0] or "")


def test_unreadable_svs_from_testdata(testdata: Path, tmp_path: Path) -> None:
    index = build_index(
        [testdata / "unreadable.svs"], tmp_path / "idx", level=0, tile_size=16, min_tissue=0
    )
    assert len(index) == 1
    for policy in ("fill", "substitute"):
        result = TileReader(index, on_error=policy).read([0])
        assert not result.ok[0] and not result.substituted[0]  # no other tile to substitute
        assert "Bogus marker length" in (result.errors[0] or "")
        assert (result.pixels == 255).all()


def test_off_level_reads_are_resized_to_tile_size(archive: Path, tmp_path: Path) -> None:
    index = build_index(
        [archive / "good.svs"], tmp_path / "idx", tile_size=128, mpp=1.0, min_tissue=0
    )
    assert index.slides[0].read_size == 256 and index.slides[0].read_level == 0
    result = TileReader(index).read([0, 1])
    assert result.pixels.shape == (2, 128, 128, 3) and result.ok.all()


class CountingPool(ThreadPoolExecutor):
    """The reader's thread pool, counting the jobs that ran to completion."""

    jobs = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        def counted() -> Any:
            result = fn(*args, **kwargs)
            with LOCK:
                CountingPool.jobs += 1
            return result

        return super().submit(counted)


LOCK = threading.Lock()


def assert_threads_change_nothing(
    index: SlideIndex,
    rows: np.ndarray,
    monkeypatch: pytest.MonkeyPatch,
    threads: int = 3,
    **options: Any,
) -> tuple[int, int, int]:
    """Read ``rows`` with one thread and with ``threads``; everything must be equal. Returns
    the jobs the threads completed and the segment decodes of each read (so callers can check
    that the threads did the work and that nothing was decoded twice)."""
    decodes = [0]
    make_decoder = TiffReader._decoder

    def counted(self: TiffReader, *args: Any) -> Any:
        decode = make_decoder(self, *args)

        def run() -> Any:
            decodes[0] += 1
            return decode()

        return run

    monkeypatch.setattr(TiffReader, "_decoder", counted)
    serial = TileReader(index, record_failures=False, **options)
    expected = serial.read(rows)
    serial_decodes, decodes[0] = decodes[0], 0
    monkeypatch.setattr(reading, "ThreadPoolExecutor", CountingPool)
    CountingPool.jobs = 0
    threaded = TileReader(index, record_failures=False, **options)
    got = threaded.read(rows, threads=threads)
    np.testing.assert_array_equal(got.pixels, expected.pixels)
    for name in ("ok", "substituted", "source_rows"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
    assert got.errors == expected.errors
    assert sorted(f["row"] for f in threaded.failures) == sorted(f["row"] for f in serial.failures)
    assert not any(t.name.startswith("wsi-decode") for t in threading.enumerate())
    return CountingPool.jobs, serial_decodes, decodes[0]


@pytest.mark.parametrize("backend", ["tiff", "openslide"])
@pytest.mark.parametrize("policy", ["fill", "substitute"])
def test_threads_give_the_serial_result(
    index: SlideIndex, policy: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole storage tiles, corrupt ones among them (OpenSlide's latch while other threads
    read through the same handle), repeated rows, two slides: threads change nothing but who
    reads, and every failure still goes through the retries and the policy."""
    bad = corrupt_rows(index)
    rows = np.random.default_rng(3).permutation(np.concatenate([np.arange(len(index)), bad]))
    jobs, _, _ = assert_threads_change_nothing(
        index, rows, monkeypatch, on_error=policy, backend=backend
    )
    bad_slide = index.columns["slide_id"][bad[0]]
    if backend == "tiff":  # every good window was read on a thread
        assert jobs >= len(rows) - 2 * len(bad)
    else:  # after a failure the bad slide's handle is latched: its reads go serial
        assert jobs >= np.count_nonzero(index.columns["slide_id"][rows] != bad_slide)


@pytest.mark.parametrize(
    "grid",
    [
        {"tile_size": 200, "level": 0},  # windows across storage tiles: stitched
        {"tile_size": 128, "mpp": 1.0},  # 256 px windows at 0.5 um/px, DCT-scaled by 2
        {"tile_size": 100, "mpp": 0.75},  # 150 px windows, decoded then resampled
    ],
)
def test_threads_decode_the_segments_of_other_windows(
    archive: Path, tmp_path: Path, grid: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    index = build_index([archive], tmp_path / "idx", min_tissue=0, **grid)
    rows = np.random.default_rng(4).permutation(len(index))[:150]
    jobs, serial, threaded = assert_threads_change_nothing(index, rows, monkeypatch, retries=0)
    assert jobs > 0
    # each segment decoded once, by a thread; a failed decode once more by the serial path
    assert threaded <= serial + 2 * len(CORRUPT)


def test_threads_plan_no_more_segments_than_the_cache_keeps(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned decodes beyond the cache would evict each other before their windows are
    stitched: the threads take what fits in half the cache, the serial path does the rest."""
    index = build_index([archive], tmp_path / "idx", min_tissue=0, tile_size=200, level=0)
    rows = np.arange(40)
    jobs, _, _ = assert_threads_change_nothing(
        index, rows, monkeypatch, pool=HandlePool(16, 8 * 256 * 256 * 3)
    )
    assert jobs == 4  # 256 px storage tiles, of which half the cache holds four


def test_threads_on_real_slides(
    testdata: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aperio 240 px storage tiles under a 256 px grid (segments) and an NDPI (OpenSlide)."""
    slides = [testdata / "CMU-1-Small-Region.svs", testdata / "test3-DAPI-2-(387).ndpi"]
    index = build_index(slides, tmp_path / "idx", tile_size=256, mpp=0.5, min_tissue=0)
    assert {s.status for s in index.slides} == {"ok"}
    jobs, _, _ = assert_threads_change_nothing(index, np.arange(len(index)), monkeypatch)
    assert jobs >= len(index)


def test_threads_on_real_slides_of_other_codecs(
    testdata: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JPEG 2000 (TCGA SVS), ZSTD with 1024 px tiles, deflate with 64 px tiles, LZW strips."""
    names = [
        "tcga-cr-7395-01a-01-ts1.svs",
        "yb10kx5k.zstd.tiff",
        "boxes.tiff",
        "small_vectra.qptiff",
    ]
    index = build_index(
        [testdata / n for n in names], tmp_path / "idx", tile_size=256, level=0, min_tissue=0
    )
    assert [s.status for s in index.slides] == ["ok"] * 4
    rows = np.random.default_rng(5).permutation(len(index))[:300]
    jobs, serial, threaded = assert_threads_change_nothing(index, rows, monkeypatch)
    assert jobs > 0 and threaded <= serial


def test_threads_read_batches_spanning_more_slides_than_the_pool_holds(
    index: SlideIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one handle allowed, planning the second slide's reads evicts the first slide's
    handle while reads planned on it are still to run: it must stay open until they have."""
    good = np.setdiff1d(np.arange(len(index)), corrupt_rows(index))
    rows = np.random.default_rng(6).permutation(good)[:40]
    assert len(np.unique(index.columns["slide_id"][rows])) == 2
    options: dict[str, Any] = {"backend": "openslide", "retries": 0}  # no kept layouts
    pool = HandlePool(max_open=1)
    jobs, _, _ = assert_threads_change_nothing(index, rows, monkeypatch, pool=pool, **options)
    assert jobs == len(rows)  # every read ran on a thread, none fell back to the serial path
    # the serial read opened both slides; the threaded one opened the first again (OpenSlide
    # handles are not kept when closed) and got the second back from the handles it held
    assert (pool.opened, pool.reopened, len(pool)) == (3, 0, 1)


def test_reads_too_small_to_pay_for_threads_start_none(
    index: SlideIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    few = np.arange(reading.MIN_THREADED_JOBS - 1)
    jobs, _, _ = assert_threads_change_nothing(index, few, monkeypatch)
    assert jobs == 0
    jobs, _, _ = assert_threads_change_nothing(index, np.arange(len(few) + 1), monkeypatch)
    assert jobs == len(few) + 1


def test_decode_threads_keep_the_raise_policy(index: SlideIndex) -> None:
    bad = int(corrupt_rows(index)[0])
    rows = np.concatenate([np.arange(8), [bad]])
    with pytest.raises(TileReadError) as info:
        TileReader(index, on_error="raise", retries=0).read(rows, threads=2)
    assert "marker" in (info.value.cause or "")
    assert [r["row"] for r in index.quarantine.read()] == [bad]


def test_option_checks(index: SlideIndex) -> None:
    with pytest.raises(ValueError, match="on_error must be one of"):
        TileReader(index, on_error="ignore")
    with pytest.raises(ValueError, match="retries"):
        TileReader(index, retries=-1)
    with pytest.raises(IndexError):
        TileReader(index).read([len(index)])
    with pytest.raises(ValueError, match="threads must be a positive int"):
        TileReader(index).read([0], threads=0)


@pytest.mark.skipif(not 2 <= usable_cores() <= 8, reason="needs 2-8 usable cores")
def test_free_cores_sees_other_processes_keeping_cores_busy() -> None:
    """With all cores but one kept busy by other processes, a batch read gets one decode
    thread, however many cores the process may use (threads waiting for a core thrash)."""
    meter = FreeCores(interval=0.2)
    assert meter(1) == 1
    with busy_cores(usable_cores() - 1):
        meter(usable_cores())  # the first call only starts the measurement
        time.sleep(0.5)
        assert meter(usable_cores()) == 1
    copy = pickle.loads(pickle.dumps(meter))  # a worker measures for itself
    assert copy._last is None and copy._free is None


class PlainReader(SlideReader):
    """A backend with the base protocol only (read_region and close), as a new one starts."""

    def __init__(self, inner: SlideReader) -> None:
        self.inner, self.path, self.meta = inner, inner.path, inner.meta

    def read_region(self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int) -> np.ndarray:
        return self.inner.read_region(l0_x, l0_y, level, l_w, l_h)

    def close(self) -> None:
        self.inner.close()

    @property
    def closed(self) -> bool:
        return self.inner.closed


def test_capabilities_are_found_by_protocol_and_a_plain_reader_reads_the_same(
    index: SlideIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        open_slide(index.slide_path(0), "tiff") as raw,
        open_slide(index.slide_path(0), "openslide") as handle,
    ):
        every = (base.ReadsInto, base.ReadsScaled, base.PlansReads, base.PlansSegments,
                 base.ReadsEncoded, base.KeepsLayout, base.Prefetching)  # fmt: skip
        assert all(supports(raw, capability) for capability in every)
        assert [c for c in every if supports(handle, c)] == [base.PlansReads]
        assert not any(supports(PlainReader(raw), capability) for capability in every)
    rows = np.arange(0, len(index), 7)
    expected = TileReader(index, record_failures=False).read(rows)
    real_open = pool_module.open_slide
    monkeypatch.setattr(pool_module, "open_slide", lambda *a: PlainReader(real_open(*a)))
    for threads in (1, 2):
        plain = TileReader(index, record_failures=False).read(rows, threads=threads)
        assert np.array_equal(plain.ok, expected.ok)
        assert np.array_equal(plain.pixels[plain.ok], expected.pixels[expected.ok])


def test_a_bad_tile_is_quarantined_once_across_processes_and_epochs(index: SlideIndex) -> None:
    # each epoch's workers are new processes: every one appended the same bad tiles again,
    # so after 100 epochs info counted 100 records per bad tile and the file kept growing
    bad = corrupt_rows(index)
    for _ in range(3):  # a new reader per epoch, as a new worker process has
        result = TileReader(index).read(bad)
        assert not result.ok.any()
    records = index.quarantine.read()
    assert sorted((r["x"], r["y"]) for r in records) == sorted(
        (int(index.columns["l0_x"][r]), int(index.columns["l0_y"][r])) for r in bad
    )


def test_a_file_rewritten_in_place_is_hashed_again(archive: Path, tmp_path: Path) -> None:
    """A slide verified once is not hashed again while its (device, inode, size, mtime) stay
    the same. Rewritten in place with other contents of the same size (same inode and size),
    only the modification time says so: the next fresh open must be refused, not read."""
    index = build_index([archive], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0)
    good = next(i for i, s in enumerate(index.slides) if s.path.endswith("good.svs"))
    rows = np.flatnonzero(index.columns["slide_id"] == good)[:4]
    reader = TileReader(index, backend="openslide")  # every open is fresh: no kept layouts
    assert reader.read(rows).ok.all()  # opened and verified
    reader.pool.close()
    path = archive / "good.svs"
    before = path.stat()
    data = bytearray(path.read_bytes())
    at = data.index(b"Aperio Image Library v12")  # the description, in the hashed head
    data[at + len("Aperio Image Library v") : at + len("Aperio Image Library v12")] = b"13"
    with open(path, "r+b") as fh:  # in place: same inode, same size
        fh.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert (path.stat().st_ino, path.stat().st_size) == (before.st_ino, before.st_size)
    result = reader.read(rows)
    assert not result.ok.any()
    assert "not the slide that was indexed" in str(result.errors[0])
