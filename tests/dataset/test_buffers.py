"""Reused batch buffers: a buffer is reused only when no tensor over it is left."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from wsi_loader.dataset import TileDataset, make_loader
from wsi_loader.dataset._buffers import BufferRing, lease
from wsi_loader.index import SlideIndex

SHAPE = (2, 4, 4, 3)


def test_buffer_is_reused_only_after_the_last_view_is_gone() -> None:
    ring = BufferRing(capacity=2)
    images, recycled = ring.take(SHAPE, shared=False)
    assert recycled and images.shape == SHAPE
    first_ptr = images.data_ptr()
    held = lease(images)
    assert held.data_ptr() == first_ptr  # same memory, no copy
    view = held[1].permute(2, 0, 1)
    del held, images
    gc.collect()
    other, recycled = ring.take(SHAPE, shared=False)  # the first is still viewed
    assert recycled and other.data_ptr() != first_ptr
    del other  # never leased: stays taken, like a batch still being read
    del view
    gc.collect()
    again, recycled = ring.take(SHAPE, shared=False)
    assert recycled and again.data_ptr() == first_ptr
    assert len(ring) == 2


def test_full_ring_falls_back_to_fresh_buffers() -> None:
    ring = BufferRing(capacity=1)
    held = lease(ring.take(SHAPE, shared=False)[0])
    fresh, recycled = ring.take(SHAPE, shared=False)
    assert not recycled and fresh.data_ptr() != held.data_ptr()
    bigger, recycled = ring.take((4, 4, 4, 3), shared=False)
    assert not recycled and bigger.shape == (4, 4, 4, 3)


def test_shared_buffers_and_pickling() -> None:
    ring = BufferRing(capacity=3)
    images, _ = ring.take(SHAPE, shared=True)
    assert images.is_shared()
    private, _ = ring.take(SHAPE, shared=False)  # in-process: numpy memory (huge pages)
    assert not private.is_shared() and private.data_ptr() != images.data_ptr()
    clone = pickle.loads(pickle.dumps(ring))
    assert clone.capacity == 3 and len(clone) == 0  # buffers never travel


def test_forwarding_a_leased_batch_copies_it() -> None:
    """torch moves a leased tensor into new shared memory before sending it to another process:
    the ring buffer is released and its later reuse cannot change the forwarded pixels."""
    ring = BufferRing(capacity=1)
    images, _ = ring.take(SHAPE, shared=False)
    images.fill_(7)
    held = lease(images)
    held.share_memory_()
    gc.collect()
    again, recycled = ring.take(SHAPE, shared=False)
    assert recycled and again.data_ptr() == images.data_ptr()
    again.fill_(9)
    assert bool((held == 7).all())


def test_lease_takes_only_ring_views() -> None:
    with pytest.raises(ValueError, match="ring buffer"):
        lease(torch.zeros(SHAPE, dtype=torch.uint8))
    with pytest.raises(ValueError, match="capacity"):
        BufferRing(capacity=0)


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_held_batches_keep_their_pixels(
    index: SlideIndex, workers: int, context: str | None
) -> None:
    """Hold every other batch (and a view of one more) across two epochs; every held batch
    still has the pixels of its rows, while the dropped ones let the workers reuse buffers."""
    loader = make_loader(
        index,
        batch_size=4,
        num_workers=workers,
        multiprocessing_context=context,
        prefetch_factor=2,
        record_failures=False,
    )
    held, views, recycled = [], [], 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            recycled += batch.recycled
            if i % 2 == 0:
                held.append(batch)
            elif i % 5 == 1:
                views.append((batch.rows.clone(), batch.images[1:].permute(0, 3, 1, 2)))
    slots = loader.dataset.buffers.capacity * max(workers, 1)  # type: ignore[attr-defined]
    assert recycled > slots  # more batches in ring buffers than there are: buffers were reused
    ds = TileDataset(index, record_failures=False)
    for batch in held:
        assert torch.equal(batch.images, ds.read_batch(batch.rows.tolist()).images)
    for rows, view in views:
        expected = ds.read_batch(rows.tolist()).images[1:].permute(0, 3, 1, 2)
        assert torch.equal(view, expected)


def test_failed_batch_gives_its_buffer_back(index: SlideIndex) -> None:
    from tests.conftest import corrupt_rows
    from wsi_loader.errors import TileReadError

    ring = BufferRing(capacity=1)
    ds = TileDataset(index, on_error="raise", retries=0, record_failures=False)
    with pytest.raises(TileReadError):
        ds.read_batch([0, int(corrupt_rows(index)[0])], buffers=ring)
    assert ds.read_batch([0, 1], buffers=ring).recycled  # the only buffer is free again


def test_copies_are_not_recycled(index: SlideIndex) -> None:
    batch = TileDataset(index).read_batch([0, 1], buffers=BufferRing())
    assert batch.recycled and batch.to("cpu").recycled  # the same tensors
    assert not batch.to("meta").recycled  # a copy elsewhere


def test_reuse_can_be_switched_off(index: SlideIndex) -> None:
    loader = make_loader(index, batch_size=4, num_workers=0, reuse_buffers=False)
    assert not any(batch.recycled for batch in loader)


def test_threads_never_share_a_buffer() -> None:
    from concurrent.futures import ThreadPoolExecutor

    ring = BufferRing(capacity=64)

    def take(_: int) -> int:
        images, _recycled = ring.take(SHAPE, shared=False)
        return images.data_ptr()

    with ThreadPoolExecutor(8) as pool:
        pointers = list(pool.map(take, range(64)))
    assert len(set(pointers)) == 64  # none leased or released: all distinct


def test_abandoned_epochs_do_not_leak_buffers(index: SlideIndex) -> None:
    """Batches in flight when an epoch is abandoned are drained by the DataLoader (persistent
    workers), and released with them: later epochs still run entirely on reused buffers."""
    loader = make_loader(
        index, batch_size=4, num_workers=2, multiprocessing_context="fork", prefetch_factor=2
    )
    for _ in range(4):
        iterator = iter(loader)
        next(iterator)
        next(iterator)
        del iterator
    assert all(batch.recycled for batch in loader)
