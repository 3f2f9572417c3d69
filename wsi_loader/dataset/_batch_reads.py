"""`BatchReads`: the Dataset `make_loader`'s DataLoader indexes with whole batches (a list of
rows, or a `BatchPlan`), each read into one `TileBatch` in a reused buffer; in worker
processes, into a slot of the loader's `SlotRing` (`wsi_loader.dataset._transport`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset, get_worker_info

from wsi_loader.dataset._batch import TileBatch
from wsi_loader.dataset._buffers import BufferRing
from wsi_loader.dataset._look_ahead import BatchPlan
from wsi_loader.dataset._tiles import TileDataset
from wsi_loader.dataset._transport import SlotRing, slot_layout


class BatchReads(Dataset[TileBatch]):
    """Adapts a `TileDataset` so that ``ds[list_of_rows]`` is one `TileBatch`, read into a
    reused buffer of ``buffers`` when given (see `wsi_loader.dataset._buffers`), or in a
    worker process into a slot of ``ring`` (set by the loader before its workers start)."""

    def __init__(
        self,
        tiles: TileDataset,
        encoded: bool = False,
        buffers: BufferRing | None = None,
        reading: torch.Tensor | None = None,
        batch_size: int = 64,
    ) -> None:
        self.tiles = tiles
        self.encoded = encoded
        self.buffers = buffers
        # shared memory: the slide each worker is reading (-1: none), so a timeout can say
        self.reading = reading
        self.batch_size = batch_size  # the largest batch a ring slot holds
        self.ring: SlotRing | None = None

    def __len__(self) -> int:
        return len(self.tiles)

    def open_ring(self, workers: int) -> SlotRing | None:
        """A new ring of batch slots for ``workers`` worker processes about to start (kept as
        ``self.ring``, which they inherit or receive); None when buffers are not reused, when
        a ``batch_transform`` may return tensors of its own, or without ``memfd``."""
        self.ring = None
        if self.buffers is None or self.tiles.batch_transform is not None:
            return None
        if not SlotRing.available():
            return None
        n, t = self.batch_size, self.tiles.tile_size
        shapes = [(n, t, t, 3)] + [(n, size, size, 3) for _, size in self.tiles.context]
        # as many batches per worker as its BufferRing had buffers (see make_loader)
        per_worker = max(1, self.buffers.capacity // len(shapes))
        self.ring = SlotRing(workers, per_worker, slot_layout(shapes)[1])
        return self.ring

    def __getitem__(self, rows: Sequence[int] | BatchPlan) -> TileBatch:
        ahead, epoch = None, None
        if isinstance(rows, BatchPlan):
            rows, ahead, epoch = rows
        worker = get_worker_info()
        buffers: BufferRing | SlotRing | None = self.buffers
        if worker is not None and self.ring is not None:
            buffers = self.ring
        if self.reading is None or worker is None:
            return self.tiles.read_batch(
                rows, encoded=self.encoded, buffers=buffers, ahead=ahead, epoch=epoch
            )
        # a numpy view of the shared slots: a plain store per slide read, no torch call
        slots, slot = self.reading.numpy(), worker.id

        def note(slide_id: int) -> None:
            slots[slot] = slide_id

        self.tiles.reader.on_slide = note
        try:
            return self.tiles.read_batch(
                rows, encoded=self.encoded, buffers=buffers, ahead=ahead, epoch=epoch
            )
        finally:
            slots[slot] = -1
