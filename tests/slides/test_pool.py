from __future__ import annotations

import os
import pickle
from pathlib import Path

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
    assert len(pool) == 1 and pool.opened == 4


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


def test_pickles_without_handles(small_svs: Path) -> None:
    pool = HandlePool(max_open=3, openslide_cache_bytes=2**20)
    pool.get(str(small_svs))
    clone = pickle.loads(pickle.dumps(pool))
    assert (clone.max_open, clone.openslide_cache_bytes, len(clone)) == (3, 2**20, 0)
    assert clone.get(str(small_svs)).read_region(0, 0, 0, 8, 8).shape == (8, 8, 3)
