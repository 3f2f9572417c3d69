"""`SlideBagDataset`: one item per slide (or per chunk of a slide) for multiple-instance learning.

Same reader, handle pool and failure policy as `TileDataset`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from wsi_loader.config import BagConfig, check_keywords, validate
from wsi_loader.dataset._samplers import key_rng
from wsi_loader.dataset._tiles import TileDataset
from wsi_loader.index._table import SlideIndex

Bag = dict[str, Any]


class SlideBagDataset(Dataset[Bag]):
    """Bags of tiles per slide.

    With ``k`` set, item ``i`` is slide ``i`` (of the slides that have tiles) with ``k`` tiles
    drawn without replacement (with replacement when the slide has fewer), deterministic for
    (seed, epoch): call ``set_epoch`` to draw new ones. With ``k=None`` every tile is returned,
    in chunks of at most ``chunk_size`` (one item per chunk). Items: ``images`` uint8
    ``(k, 3, H, W)``, ``label``, ``ok`` ``(k,)``, ``substituted`` ``(k,)``, ``x``, ``y``, ``rows``
    ``(k,)``, ``slide_id``; with context scales (``context=``, or the index's default) also
    ``context`` (one uint8 ``(k, 3, S, S)`` per scale) and ``context_inside`` ``(k, scales,
    4)``. Other keyword options are `TileDataset`'s (``on_error``, ``split``,
    ``missing_slides``, ``decode_threads``...), validated the same way.

    The epoch lives in shared memory, so ``set_epoch`` in the main process reaches
    DataLoader workers that are already running (``persistent_workers=True``).
    """

    def __init__(
        self,
        index: SlideIndex | str | os.PathLike[str],
        k: int | None = 16,
        *,
        chunk_size: int = 256,
        seed: int = 0,
        **options: Any,
    ) -> None:
        check_keywords(
            "SlideBagDataset", options, [*TileDataset.option_names(), "k", "chunk_size", "seed"]
        )
        checked: BagConfig = validate(BagConfig, {"k": k, "chunk_size": chunk_size, "seed": seed})
        if "transform" in options or "batch_transform" in options:
            raise TypeError("SlideBagDataset takes no transform: apply it to the bag's images")
        # the same reader, pool, failure policy and labels as the tile dataset
        self.tiles = TileDataset(index, **options)
        index = self.tiles.index
        self.index, self.k, self.chunk_size = index, checked.k, checked.chunk_size
        self.seed = checked.seed
        k, chunk_size = self.k, self.chunk_size
        self._epoch = torch.zeros(1, dtype=torch.int64)
        self._epoch.share_memory_()  # type: ignore[no-untyped-call]
        self.reader = self.tiles.reader
        self.starts = index.slide_starts()
        counts = np.diff(self.starts)
        self.slide_ids = np.flatnonzero(counts > 0)
        self.slide_labels = self.tiles.slide_labels
        self.label_names = self.tiles.slide_label_names  # bags carry slide labels
        if k is None:  # (slide, chunk) pairs: one item per chunk of every slide
            chunks = -(-counts[self.slide_ids] // chunk_size)
            self.item_slide = np.repeat(self.slide_ids, chunks)
            firsts = np.repeat(np.cumsum(chunks) - chunks, chunks)
            self.item_chunk = np.arange(int(chunks.sum()), dtype=np.int64) - firsts

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Draw new bags: takes effect in running DataLoader workers too (shared memory)."""
        self._epoch[0] = int(epoch)

    def __len__(self) -> int:
        return len(self.slide_ids) if self.k is not None else len(self.item_slide)

    def _rows(self, i: int) -> tuple[int, np.ndarray]:
        if self.k is None:
            slide = int(self.item_slide[i])
            lo = int(self.starts[slide]) + int(self.item_chunk[i]) * self.chunk_size
            return slide, np.arange(lo, min(lo + self.chunk_size, int(self.starts[slide + 1])))
        slide = int(self.slide_ids[i])
        lo, hi = int(self.starts[slide]), int(self.starts[slide + 1])
        rng = key_rng(self.seed, self.epoch, slide)
        picks = rng.choice(hi - lo, size=self.k, replace=hi - lo < self.k)
        return slide, lo + np.sort(picks).astype(np.int64)

    def __getitem__(self, i: int) -> Bag:
        if not 0 <= i < len(self):
            raise IndexError(f"item {i} out of range for {len(self)} bags")
        slide, rows = self._rows(i)
        result = self.tiles.read_rows(rows)
        cols = self.index.columns
        bag: Bag = {
            # NCHW made by numpy: no call into torch's intra-op thread pool
            "images": torch.from_numpy(np.ascontiguousarray(result.pixels.transpose(0, 3, 1, 2))),
            "label": int(self.slide_labels[slide]),
            # small copies that torch owns (a numpy-backed tensor would be copied into shared
            # memory on its way through the worker queue anyway)
            "ok": torch.tensor(result.ok),
            "substituted": torch.tensor(result.substituted),
            "x": torch.tensor(np.asarray(cols["l0_x"][rows], dtype=np.int64)),
            "y": torch.tensor(np.asarray(cols["l0_y"][rows], dtype=np.int64)),
            "rows": torch.tensor(rows),
            "slide_id": slide,
        }
        if self.tiles.context:  # the instances' context tiles, one (k, 3, S, S) per scale
            bag["context"] = [
                torch.from_numpy(np.ascontiguousarray(tiles.transpose(0, 3, 1, 2)))
                for tiles in result.context
            ]
            bag["context_inside"] = torch.from_numpy(np.array(result.context_inside))
        return bag
