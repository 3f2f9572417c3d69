"""`make_loader`'s thread path: batches read by a thread of this process, ahead of the consumer
(`wsi_loader.dataset._threaded`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.conftest import corrupt_rows
from wsi_loader.dataset import TileBatch, make_loader
from wsi_loader.dataset._choice import ReaderChoice
from wsi_loader.dataset._loader import TileLoader
from wsi_loader.dataset._threaded import ReadAhead
from wsi_loader.errors import TileReadError
from wsi_loader.index import SlideIndex
from wsi_loader.index._quarantine import Quarantine

WAIT_S = 60.0  # liveness bound: the events below come at once on an idle machine


def _reading_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wsi-loader-reads" and t.is_alive()]


def _threaded(index: SlideIndex, **options: object) -> TileLoader:
    """A loader on the thread path whatever the cores of the machine running the test."""
    loader = make_loader(index, num_workers=0, **options)  # type: ignore[arg-type]
    loader.readers = ReaderChoice("threads", 0, 2, "test")
    loader.read_ahead = 2
    return loader


def test_threads_read_the_batches_the_consumer_thread_reads(index: SlideIndex) -> None:
    threaded = list(_threaded(index, batch_size=16, seed=5))
    recorded = {r["row"] for r in Quarantine(index.path / "quarantine.jsonl").tile_records()}
    assert recorded == set(corrupt_rows(index).tolist())  # recorded by the reading thread
    direct = make_loader(index, batch_size=16, seed=5, num_workers=0)
    pairs = list(zip(threaded, direct, strict=True))
    assert len(pairs) == -(-len(index) // 16)
    for a, b in pairs:
        assert isinstance(a, TileBatch)
        assert torch.equal(a.rows, b.rows) and torch.equal(a.images, b.images)
        assert torch.equal(a.ok, b.ok) and torch.equal(a.slide_id, b.slide_id)
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    bad = np.concatenate([a.rows[~a.ok].numpy() for a, _ in pairs])
    assert sorted(bad.tolist()) == sorted(corrupt_rows(index).tolist())
    assert not _reading_threads()  # the epoch is over: its thread is gone


def test_an_error_of_the_reading_thread_is_raised_to_the_consumer(index: SlideIndex) -> None:
    bad = corrupt_rows(index)[:1].tolist()
    good = [r for r in range(len(index)) if r not in set(corrupt_rows(index).tolist())][:4]
    loader = _threaded(index, batches=[good, bad, good], on_error="raise")
    seen = []
    with pytest.raises(TileReadError):
        for batch in loader:
            seen.append(batch.rows.tolist())
    assert seen == [good]  # the batch read before the error arrives first
    assert not _reading_threads()


def test_a_consumer_that_stops_early_stops_the_reading_thread(index: SlideIndex) -> None:
    loader = _threaded(index, batch_size=4, shuffle=False)
    batches = iter(loader)
    next(batches)
    assert len(_reading_threads()) == 1
    batches.close()  # what a `break` out of the loop does when the iterator goes
    assert not _reading_threads()
    assert sum(len(b) for b in loader) == len(index)  # a new epoch reads everything


def test_reads_run_at_most_depth_batches_ahead() -> None:
    produced: list[int] = []
    third = threading.Event()

    def source() -> Iterator[int]:
        for i in range(100):
            produced.append(i)
            if len(produced) == 3:
                third.set()
            yield i

    ahead = ReadAhead(source(), depth=2)
    try:
        assert third.wait(WAIT_S)  # two queued, the third waiting for room
        time.sleep(0.2)  # a thread that ignored the bound would read on meanwhile
        assert len(produced) == 3
        assert next(ahead) == 0
        assert [next(ahead) for _ in range(5)] == [1, 2, 3, 4, 5]
    finally:
        ahead.close()
    assert not ahead.alive


def test_errors_follow_the_items_read_before_them() -> None:
    def source() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("slide went away")

    ahead = ReadAhead(source(), depth=4)
    assert [next(ahead), next(ahead)] == [1, 2]
    with pytest.raises(ValueError, match="slide went away"):
        next(ahead)
    assert not ahead.alive
    with pytest.raises(StopIteration):
        next(ahead)


def test_a_dropped_iterator_stops_its_thread() -> None:
    ahead = ReadAhead(iter(range(1000)), depth=1)
    thread = ahead._thread
    del ahead  # no close: the finaliser tells the thread to stop
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_workers_fork_cleanly_after_a_threaded_epoch(index: SlideIndex) -> None:
    for _ in _threaded(index, batch_size=16):
        pass
    forked = make_loader(index, batch_size=16, num_workers=2, multiprocessing_context="fork")
    assert sum(len(b) for b in forked) == len(index)
