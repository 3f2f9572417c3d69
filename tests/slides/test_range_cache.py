"""The range store on its own, over a source whose requests answer at once (no server)."""

from __future__ import annotations

import concurrent.futures

from wsi_loader.slides.storage._range_cache import RangeStore
from wsi_loader.slides.storage._request_plan import CostModel

DATA = bytes(range(256)) * 16384  # a 4 MiB object


class Source:
    key = ("s3://bucket/object", "etag-1")

    def __init__(self) -> None:
        self.model = CostModel()
        self.asked: list[tuple[int, int]] = []

    def submit(self, offset: int, size: int) -> concurrent.futures.Future[bytes]:
        self.asked.append((offset, size))
        future: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        future.set_result(DATA[offset : offset + size])
        return future


def test_a_range_inside_a_large_block_is_served_from_it_past_many_smaller_blocks() -> None:
    """Blocks that start inside a large one must not hide it: the lookup used to look at the
    8 blocks that start closest before a range only, and asked the bucket again."""
    source, store = Source(), RangeStore()
    for i in range(20):  # small blocks first (single ranges, far apart)...
        store.start(source, [(100_000 + 50_000 * i, 10)])
    store.start(source, [(0, 2_000_000)])  # ...then a large one over all of them
    assert len(source.asked) == 21
    store.start(source, [(1_500_000, 30_000)])  # inside the large block only
    assert len(source.asked) == 21
    assert store.take(source.key, 1_500_000, 30_000) == DATA[1_500_000:1_530_000]


def test_landed_blocks_keep_their_bytes_not_their_futures() -> None:
    source, store = Source(), RangeStore()
    store.start(source, [(4096, 8192)])
    assert store.take(source.key, 4096, 8192) == DATA[4096:12288]
    block = store._blocks[(source.key, 4096)]
    assert block.future is None and block.data == DATA[4096:12288]
    assert store.take(source.key, 5000, 100) == DATA[5000:5100]  # cut from the kept bytes
    assert store.stats()["reads"] == 2 and store.stats()["hits"] == 2
