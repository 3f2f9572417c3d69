"""The decoded-segment cache: a segmented LRU, so segments used again outlive a stream of
segments used once (random tiles of a big slide) under the same byte bound; and windows
stitched from cached segments straight into the caller's buffer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsi_loader.slides._segment_cache import SegmentCache
from wsi_loader.slides._tiff import TiffReader

KB = 1024


def segment() -> np.ndarray:
    return np.zeros((16, 16, 4), dtype=np.uint8)  # 1 KiB


def key(i: int, level: int = 0) -> tuple[str, int, int, int]:
    return ("a.svs", level, i, 1)


def total(cache: SegmentCache) -> int:
    return sum(cache.get(key(i)) is not None for i in range(1000))


def test_a_segment_used_again_outlives_a_stream_of_segments_used_once() -> None:
    cache = SegmentCache(10 * KB)
    coarse = ("a.svs", 1, 0, 1)
    cache.put(coarse, segment())
    assert cache.get(coarse) is not None  # used again: protected
    for i in range(100):  # 100 KiB of segments used once through a 10 KiB cache
        cache.put(key(i), segment())
        assert coarse in cache
    assert cache.get(coarse) is not None
    # a plain LRU would have dropped it after 10 puts; the bound holds all the same
    assert sum(key(i) in cache for i in range(100)) == 9


def test_looking_is_not_using_and_a_planned_segment_is_used_once_before_it_counts() -> None:
    cache = SegmentCache(4 * KB)
    planned, looked, reused = key(1, level=1), key(2, level=1), key(3, level=1)
    cache.put(planned, segment(), planned=True)
    cache.put(looked, segment())
    cache.put(reused, segment())
    assert planned in cache and looked in cache  # `in` moves nothing
    assert cache.get(planned) is not None  # the use it was decoded for: still on probation
    assert cache.get(reused) is not None  # used again: protected
    for i in range(4):
        cache.put(key(10 + i), segment())
    assert planned not in cache and looked not in cache  # neither was used again
    assert reused in cache


def test_the_protected_part_is_at_most_half_and_falls_back_to_probation() -> None:
    cache = SegmentCache(8 * KB)
    for i in range(8):
        cache.put(key(i), segment())
        cache.get(key(i))  # every one used again
    assert all(key(i) in cache for i in range(8))
    cache.put(key(100), segment())  # 9 KiB: the least recent goes (demoted first)
    assert sum(key(i) in cache for i in range(8)) == 7 and key(0) not in cache
    assert cache.pop(key(7)) is not None and key(7) not in cache
    cache.clear()
    assert not any(key(i) in cache for i in range(101))
    big = np.zeros((9 * KB,), dtype=np.uint8)
    cache.put(key(200), big)  # larger than the cache: not kept
    assert key(200) not in cache


def test_segments_decoded_ahead_stay_until_their_read() -> None:
    """Decode threads put a batch's segments before its windows read them: those are kept
    until read, before older segments, whatever was used again meanwhile (the whole-slide
    scan of test_scan decoded 1.55x its storage tiles when they were evicted first)."""
    cache = SegmentCache(8 * KB)
    for i in range(4):  # the protected half full of segments used again, never needed more
        cache.put(key(i), segment())
        cache.get(key(i))
    ahead = [key(100 + i, level=0) for i in range(4)]
    for k in ahead:
        cache.put(k, segment(), planned=True)
    for i in range(4):  # used once each by the reads of the batch meanwhile
        cache.put(key(200 + i), segment())
        assert all(k in cache for k in ahead)
    for k in ahead:
        assert cache.get(k) is not None  # the read it was decoded for


def test_a_window_is_stitched_into_its_slot_white_where_no_segment_covers_it(
    small_svs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows are stitched straight into the caller's buffer, which holds an earlier batch's
    pixels: a window inside the level is written whole by its segments, and a segment that
    decodes short (a malformed file) leaves white, never the buffer's old pixels."""
    reader = TiffReader(str(small_svs))
    x, y, size = 100, 140, 224  # across four 256 px storage tiles
    expected = reader.read_region(x, y, 0, size, size)
    slot = np.full((size, size, 3), 7, dtype=np.uint8)
    reader.read_region_into(slot, x, y, 0, size, size)
    np.testing.assert_array_equal(slot, expected)
    whole = reader._segment
    short = 1  # the segment right of the first: decodes 200 rows instead of 256

    def segment(level: int, index: int, scale: int = 1) -> np.ndarray:
        pixels = whole(level, index, scale)
        return pixels[:200] if index == short else pixels

    monkeypatch.setattr(reader, "_segment", segment)
    slot[...] = 7
    reader.read_region_into(slot, x, y, 0, size, size)
    assert (slot == 7).sum() == 0
    missing = slot[200 - y : 256 - y, 256 - x :]  # rows 200..255 of segment 1: not decoded
    assert missing.size and (missing == 255).all()
    np.testing.assert_array_equal(slot[: 200 - y], expected[: 200 - y])
    np.testing.assert_array_equal(slot[:, : 256 - x], expected[:, : 256 - x])
