from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SlideFactory
from wsi_loader.errors import TileReadError
from wsi_loader.slides import HandlePool


def test_lazy_lru_and_close_on_eviction(make_slide: SlideFactory) -> None:
    paths = [str(make_slide(width=600, height=600, seed=s)) for s in range(3)]
    pool = HandlePool(max_open=2)
    assert len(pool) == 0
    first = pool.get(paths[0])
    assert pool.get(paths[0]) is first and pool.opened == 1
    pool.get(paths[1])
    pool.get(paths[2])  # evicts paths[0], the least recently used
    assert len(pool) == 2
    assert first.closed is True  # closed on eviction
    pool.close()
    assert len(pool) == 0


def test_readers_evicted_while_holding_close_when_it_ends(make_slide: SlideFactory) -> None:
    paths = [str(make_slide(width=600, height=600, seed=s)) for s in range(3)]
    pool = HandlePool(max_open=1)
    with pool.holding():
        first, second = pool.get(paths[0]), pool.get(paths[1])
        pool.get(paths[2])
        assert len(pool) == 1 and not first.closed and not second.closed
        assert first.read_region(0, 0, 0, 8, 8).shape == (8, 8, 3)  # still usable
        with pytest.raises(RuntimeError, match="nest"), pool.holding():
            pass
    assert first.closed and second.closed and len(pool) == 1
    pool.get(paths[0])  # outside the block eviction closes at once again
    assert len(pool) == 1 and (pool.opened, pool.reopened) == (3, 1)


def open_fds(paths: list[str]) -> dict[str, int]:
    """How many descriptors of this process are open on each of ``paths`` (the other
    descriptors come and go with threads of earlier tests: counting all of them is flaky)."""
    wanted = {os.path.realpath(p): p for p in paths}
    counts = dict.fromkeys(paths, 0)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target in wanted:
            counts[wanted[target]] += 1
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_evicted_raw_readers_reopen_without_a_parse(make_slide: SlideFactory) -> None:
    """Random batches over more slides than max_open reopen slides all the time: a raw reader
    keeps its parsed layout when evicted, so reopening costs an open() and no parse."""
    paths = [str(make_slide(width=600, height=600, seed=s)) for s in range(3)]
    pool = HandlePool(max_open=1)
    first = pool.get(paths[0], "tiff")
    expected = first.read_region(100, 100, 0, 200, 200)
    assert open_fds(paths) == {paths[0]: 1, paths[1]: 0, paths[2]: 0}
    pool.get(paths[1], "tiff")
    pool.get(paths[2], "tiff")
    assert first.closed  # evicted readers hold no file open
    assert open_fds(paths) == {paths[0]: 0, paths[1]: 0, paths[2]: 1}
    again = pool.get(paths[0], "tiff")
    assert again is first and not again.closed
    assert (pool.opened, pool.reopened) == (3, 1)
    np.testing.assert_array_equal(again.read_region(100, 100, 0, 200, 200), expected)
    pool.discard(paths[1], "tiff")  # forgets the kept layout too
    pool.get(paths[1], "tiff")
    assert (pool.opened, pool.reopened) == (4, 1)
    pool.close()
    assert open_fds(paths) == dict.fromkeys(paths, 0)


def test_a_changed_file_is_parsed_again(make_slide: SlideFactory, tmp_path: Path) -> None:
    path = tmp_path / "slide.svs"
    shutil.copy(make_slide(width=600, height=600, seed=1), path)
    other = str(make_slide(width=600, height=600, seed=2))
    pool = HandlePool(max_open=1)
    stale = pool.get(str(path), "tiff")
    pool.get(other, "tiff")  # evicts, keeps the layout
    shutil.copy(make_slide(width=900, height=500, seed=3), path)  # rewritten meanwhile
    fresh = pool.get(str(path), "tiff")
    assert fresh is not stale and (pool.opened, pool.reopened) == (3, 0)
    assert fresh.meta.level_dimensions[0] == (900, 500)


def test_the_layout_budget_bounds_what_closed_readers_keep(make_slide: SlideFactory) -> None:
    paths = [str(make_slide(width=600, height=600, seed=s)) for s in range(3)]
    none_kept = HandlePool(max_open=1, layout_cache_bytes=0)
    for path in paths + paths:
        none_kept.get(path, "tiff")
    assert (none_kept.opened, none_kept.reopened) == (6, 0)
    size = none_kept.get(paths[0], "tiff").layout_bytes()  # type: ignore[attr-defined]
    assert 0 < size < 64 * 1024  # compact: int64 offsets and counts, no tifffile page
    one_kept = HandlePool(max_open=1, layout_cache_bytes=size)
    for path in paths + paths:
        one_kept.get(path, "tiff")
    assert one_kept.reopened == 0  # each layout evicted before its slide came back
    one_kept.get(paths[2], "tiff")
    one_kept.get(paths[1], "tiff")
    assert one_kept.reopened == 1


def test_broken_reader_is_reopened(make_slide: SlideFactory) -> None:
    path = str(make_slide(corrupt=[(0, 0)], width=600, height=600, seed=9))
    pool = HandlePool()
    reader = pool.get(path, "openslide")  # OpenSlide errors latch
    with pytest.raises(TileReadError):
        reader.read_region(0, 0, 0, 64, 64)
    again = pool.get(path, "openslide")
    assert again is not reader and pool.opened == 2
    assert again.read_region(300, 300, 0, 64, 64).shape == (64, 64, 3)


def test_forked_child_starts_empty(small_svs: Path) -> None:
    pool = HandlePool()
    parent_reader = pool.get(str(small_svs))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not reuse the parent's handle
        try:
            ok = len(pool) == 0 and pool.get(str(small_svs)) is not parent_reader
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert pool.get(str(small_svs)) is parent_reader


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="max_open"):
        HandlePool(max_open=0)
    with pytest.raises(ValueError, match="openslide_cache_bytes"):
        HandlePool(openslide_cache_bytes=-1)
    with pytest.raises(ValueError, match="layout_cache_bytes"):
        HandlePool(layout_cache_bytes=-1)


def test_pickles_without_handles(small_svs: Path) -> None:
    pool = HandlePool(max_open=3, openslide_cache_bytes=2**20)
    pool.get(str(small_svs))
    clone = pickle.loads(pickle.dumps(pool))
    assert (clone.max_open, clone.openslide_cache_bytes, len(clone)) == (3, 2**20, 0)
    assert clone.layout_cache_bytes == pool.layout_cache_bytes
    assert clone.get(str(small_svs)).read_region(0, 0, 0, 8, 8).shape == (8, 8, 3)
