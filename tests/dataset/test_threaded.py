"""`make_loader`'s thread path: batches read by threads of this process, ahead of the consumer
(`wsi_loader.dataset._threaded`)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tests.conftest import corrupt_rows
from wsi_loader.dataset import TileBatch, make_loader
from wsi_loader.dataset._choice import ReaderChoice
from wsi_loader.dataset._loader import TileLoader
from wsi_loader.dataset._threaded import THREAD_NAME, read_ahead
from wsi_loader.errors import TileReadError
from wsi_loader.index import SlideIndex
from wsi_loader.index._quarantine import Quarantine

WAIT_S = 60.0  # liveness bound: the events below come at once on an idle machine


def _reading_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME) and t.is_alive()]


def _threaded(index: SlideIndex, **options: object) -> TileLoader:
    """A loader on the thread path whatever the cores of the machine running the test."""
    loader = make_loader(index, num_workers=0, **options)  # type: ignore[arg-type]
    loader.readers = ReaderChoice("threads", 0, 2, "test")  # two reader threads
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
    assert not _reading_threads()  # the epoch is over: its threads are gone


def test_each_reader_thread_reads_with_its_own_copy_kept_between_epochs(
    index: SlideIndex,
) -> None:
    loader = _threaded(index, batch_size=16)
    assert sum(len(b) for b in loader) == len(index)
    copies = loader._copies
    assert copies is not None and len(copies) == 2
    pools = {id(copy.tiles.reader.pool) for copy in copies}
    assert len(pools) == 2 and id(loader.dataset.tiles.reader.pool) not in pools
    assert all(copy.tiles.decode_threads == 1 for copy in copies)  # one decode thread each
    assert loader.dataset.tiles.decode_threads is None  # the caller's dataset untouched
    assert all(len(copy.tiles.reader.pool) for copy in copies)  # each opened its slides
    assert sum(len(b) for b in loader) == len(index)
    assert loader._copies is copies  # the next epoch reads with the same, warm, copies


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
    assert len(_reading_threads()) == 2
    batches.close()  # what a `break` out of the loop does when the iterator goes
    assert not _reading_threads()
    assert sum(len(b) for b in loader) == len(index)  # a new epoch reads everything


def test_reads_run_at_most_depth_batches_ahead_and_come_in_order() -> None:
    started: list[int] = []
    fourth = threading.Event()

    def read(reader: int, plan: int) -> tuple[int, int]:
        started.append(plan)
        if len(started) == 4:
            fourth.set()
        return reader, plan

    reads = read_ahead(range(100), read, readers=2, depth=3)
    try:
        first = next(reads)  # three in flight, then the consumer holds the first
        # the first was taken, so one more is asked for: the fourth starts (waited for as
        # an event: on a loaded machine a reader thread may wait long for a core) ...
        assert fourth.wait(WAIT_S)
        time.sleep(0.2)  # ... and readers that ignored the bound would read on meanwhile
        assert len(started) == 4
        assert first == (0, 0)
        rest = list(reads)
    finally:
        reads.close()  # a failed assert leaves no reading thread to the next tests
    assert [plan for _, plan in rest] == list(range(1, 100))  # in order
    assert all(reader == plan % 2 for reader, plan in rest)  # plan i on reader i % readers
    assert not _reading_threads()


def test_errors_follow_the_batches_read_before_them() -> None:
    def read(reader: int, plan: int) -> int:
        if plan == 2:
            raise ValueError("slide went away")
        return plan

    reads = read_ahead(range(10), read, readers=2, depth=4)
    assert [next(reads), next(reads)] == [0, 1]
    with pytest.raises(ValueError, match="slide went away"):
        next(reads)
    assert not _reading_threads()
    with pytest.raises(StopIteration):
        next(reads)


def test_a_dropped_iteration_ends_its_threads() -> None:
    reads = read_ahead(iter(range(1000)), lambda reader, plan: plan, readers=2, depth=2)
    next(reads)
    assert _reading_threads()
    del reads  # no close: the generator is collected, which closes it
    assert not _reading_threads()


def test_workers_fork_cleanly_after_a_threaded_epoch(index: SlideIndex) -> None:
    for _ in _threaded(index, batch_size=16):
        pass
    forked = make_loader(index, batch_size=16, num_workers=2, multiprocessing_context="fork")
    assert sum(len(b) for b in forked) == len(index)
