"""`SlideBagDataset`: one item per slide (or per chunk of a slide) for multiple-instance learning.

Same reader, handle pool and failure policy as `TileDataset`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from wsi_loader.dataset.tiles import TileDataset
from wsi_loader.index.table import SlideIndex

Bag = dict[str, Any]


class SlideBagDataset(Dataset[Bag]):
    """Bags of tiles per slide.

    With ``k`` set, item ``i`` is slide ``i`` (of the slides that have tiles) with ``k`` tiles
    drawn without replacement (with replacement when the slide has fewer), deterministic for
    (seed, epoch): call ``set_epoch`` to draw new ones. With ``k=None`` every tile is returned,
    in chunks of at most ``chunk_size`` (one item per chunk). Items: ``images`` uint8
    ``(k, 3, H, W)``, ``label``, ``ok`` ``(k,)``, ``substituted`` ``(k,)``, ``x``, ``y``, ``rows``
    ``(k,)``, ``slide_id``. ``decode_threads`` as in `TileDataset`.
    """

    def __init__(
        self,
        index: SlideIndex | str | os.PathLike[str],
        k: int | None = 16,
        *,
        chunk_size: int = 256,
        seed: int = 0,
        on_error: str = "fill",
        retries: int = 2,
        fill_value: int = 255,
        max_open_slides: int = 16,
        openslide_cache_mb: int = 64,
        layout_cache_mb: int = 64,
        exclude_quarantined: bool = False,
        root: str | None = None,
        record_failures: bool = True,
        decode_threads: int | None = None,
    ) -> None:
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be a positive int or None, got {k!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        # the same reader, pool, failure policy and labels as the tile dataset
        self.tiles = TileDataset(
            index,
            on_error=on_error,
            retries=retries,
            fill_value=fill_value,
            max_open_slides=max_open_slides,
            openslide_cache_mb=openslide_cache_mb,
            layout_cache_mb=layout_cache_mb,
            exclude_quarantined=exclude_quarantined,
            root=root,
            record_failures=record_failures,
            decode_threads=decode_threads,
        )
        index = self.tiles.index
        self.index, self.k, self.chunk_size, self.seed = index, k, chunk_size, seed
        self.epoch = 0
        self.reader = self.tiles.reader
        self.starts = index.slide_starts()
        counts = np.diff(self.starts)
        self.slide_ids = np.flatnonzero(counts > 0)
        self.slide_labels = self.tiles.slide_labels
        self.label_names = self.tiles.label_names
        if k is None:  # (slide, chunk) pairs: one item per chunk of every slide
            chunks = -(-counts[self.slide_ids] // chunk_size)
            self.item_slide = np.repeat(self.slide_ids, chunks)
            firsts = np.repeat(np.cumsum(chunks) - chunks, chunks)
            self.item_chunk = np.arange(int(chunks.sum()), dtype=np.int64) - firsts

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.slide_ids) if self.k is not None else len(self.item_slide)

    def _rows(self, i: int) -> tuple[int, np.ndarray]:
        if self.k is None:
            slide = int(self.item_slide[i])
            lo = int(self.starts[slide]) + int(self.item_chunk[i]) * self.chunk_size
            return slide, np.arange(lo, min(lo + self.chunk_size, int(self.starts[slide + 1])))
        slide = int(self.slide_ids[i])
        lo, hi = int(self.starts[slide]), int(self.starts[slide + 1])
        rng = np.random.default_rng([self.seed, self.epoch, slide])
        picks = rng.choice(hi - lo, size=self.k, replace=hi - lo < self.k)
        return slide, lo + np.sort(picks).astype(np.int64)

    def __getitem__(self, i: int) -> Bag:
        if not 0 <= i < len(self):
            raise IndexError(f"item {i} out of range for {len(self)} bags")
        slide, rows = self._rows(i)
        result = self.tiles.read_rows(rows)
        cols = self.index.columns
        return {
            "images": torch.from_numpy(result.pixels).permute(0, 3, 1, 2).contiguous(),
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
