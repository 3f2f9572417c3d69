"""`TileDataset`: a torch Dataset over the rows of a `SlideIndex`.

Handles are opened lazily in the process that reads (a per-process `HandlePool`), so the same
dataset object works with ``num_workers=0``, forked and spawned DataLoader workers without a
``worker_init_fn``; it pickles without handles or tile data. Per-tile state lives only in the
index's memory-mapped numpy columns, so worker memory stays flat in the index size.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from wsi_loader.config import DatasetConfig
from wsi_loader.dataset.batch import TileBatch
from wsi_loader.dataset.buffers import BufferRing, fresh_buffer, lease, release
from wsi_loader.dataset.reading import ReadResult, TileReader, threads_per_process
from wsi_loader.dataset.worker_exit import let_queue_feeders_finish  # noqa: F401 (registers it)
from wsi_loader.index.table import SlideIndex
from wsi_loader.slides.pool import HandlePool

Sample = dict[str, Any]
Transform = Callable[[torch.Tensor], torch.Tensor]


class TileDataset(Dataset[Sample]):
    """One sample per index row.

    ``ds[row]`` is a dict: ``image`` (uint8 ``(3, H, W)`` RGB), ``label`` (label id, -1 when
    unlabelled; names in ``label_names``), ``ok`` (False when the read failed), ``substituted``,
    ``row``, ``slide_id`` and ``x``, ``y`` (level-0 top-left). ``transform`` is applied to the
    uint8 image tensor.

    ``max_open_slides``: files open per process (LRU); ``layout_cache_mb``: parsed layouts
    that raw-read slides keep when closed, so reopening them is cheap (see `HandlePool`).
    ``decode_threads``: threads that read and decode the tiles of one batch read (`read_batch`,
    ``__getitems__``; see `TileReader.read`). ``None`` divides the usable cores among the
    reading processes: all of them with ``num_workers=0``, one each with one worker per core.
    """

    def __init__(
        self,
        index: SlideIndex | str | os.PathLike[str],
        *,
        on_error: str = "fill",
        retries: int = 2,
        fill_value: int = 255,
        transform: Transform | None = None,
        max_open_slides: int = 16,
        openslide_cache_mb: int = 64,
        layout_cache_mb: int = 64,
        exclude_quarantined: bool = False,
        root: str | None = None,
        backend: str | None = None,
        record_failures: bool = True,
        decode_threads: int | None = None,
    ) -> None:
        if decode_threads is not None and (
            not isinstance(decode_threads, int) or decode_threads < 1
        ):
            raise ValueError(
                f"decode_threads must be a positive int or None, got {decode_threads!r}"
            )
        self.decode_threads = decode_threads
        if not isinstance(index, SlideIndex):
            index = SlideIndex.open(index, root=root, exclude_quarantined=exclude_quarantined)
        self.index = index
        self.transform = transform
        self.reader = TileReader(
            index,
            on_error=on_error,
            retries=retries,
            fill_value=fill_value,
            pool=HandlePool(max_open_slides, openslide_cache_mb * 2**20, layout_cache_mb * 2**20),
            backend=backend,
            record_failures=record_failures,
        )
        self.slide_labels = index.slide_labels()
        self.label_names = index.label_names

    @classmethod
    def from_config(
        cls, index: SlideIndex | str | os.PathLike[str], config: DatasetConfig, **kwargs: Any
    ) -> TileDataset:
        return cls(
            index,
            on_error=config.on_error,
            retries=config.retries,
            fill_value=config.fill_value,
            max_open_slides=config.max_open_slides,
            openslide_cache_mb=config.openslide_cache_mb,
            layout_cache_mb=config.layout_cache_mb,
            exclude_quarantined=config.exclude_quarantined,
            decode_threads=config.decode_threads,
            **kwargs,
        )

    @property
    def tile_size(self) -> int:
        return self.reader.tile_size

    @property
    def failures(self) -> list[dict[str, Any]]:
        """Failures seen by this process (every process also appends them to the quarantine)."""
        return self.reader.failures

    def __len__(self) -> int:
        return len(self.index)

    def threads_here(self) -> int:
        """Decode threads for a batch read in this process (see ``decode_threads``)."""
        if self.decode_threads is not None:
            return self.decode_threads
        worker = get_worker_info()
        return threads_per_process(worker.num_workers if worker is not None else 1)

    def read_rows(
        self, rows: np.ndarray, out: np.ndarray | None = None, encoded: bool = False
    ) -> ReadResult:
        """`TileReader.read` with this process's decode threads."""
        return self.reader.read(rows, out=out, encoded=encoded, threads=self.threads_here())

    def _samples(self, rows: np.ndarray, result: ReadResult) -> list[Sample]:
        cols = self.index.columns
        samples = []
        for i, row in enumerate(rows.tolist()):
            slide_id = int(cols["slide_id"][row])
            image = torch.from_numpy(result.pixels[i]).permute(2, 0, 1).contiguous()
            if self.transform is not None:
                image = self.transform(image)
            samples.append(
                {
                    "image": image,
                    "label": int(self.slide_labels[slide_id]),
                    "ok": bool(result.ok[i]),
                    "substituted": bool(result.substituted[i]),
                    "row": int(row),
                    "slide_id": slide_id,
                    "x": int(cols["l0_x"][row]),
                    "y": int(cols["l0_y"][row]),
                }
            )
        return samples

    def __getitem__(self, row: int) -> Sample:
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} out of range for {len(self)} tiles")
        rows = np.array([row % len(self)], dtype=np.int64)
        return self._samples(rows, self.reader.read(rows))[0]

    def __getitems__(self, rows: Sequence[int]) -> list[Sample]:
        """Batched reads (used by DataLoader): rows are read grouped by slide."""
        array = np.asarray(rows, dtype=np.int64)
        return self._samples(array, self.read_rows(array))

    def read_batch(
        self, rows: Sequence[int], encoded: bool = False, buffers: BufferRing | None = None
    ) -> TileBatch:
        """Read rows into one `TileBatch` (NHWC uint8); see `make_loader`.

        With ``buffers``, the pixels go into a buffer of that ring that is reused once no
        tensor over this batch is left (``batch.recycled``; see `wsi_loader.dataset.buffers`).
        """
        array = np.asarray(rows, dtype=np.int64)
        t = self.tile_size
        shape = (len(array), t, t, 3)
        # decoded straight into this buffer (shared memory inside a DataLoader worker)
        in_worker = get_worker_info() is not None
        if buffers is not None:
            images, recycled = buffers.take(shape, shared=in_worker)
        else:
            images, recycled = fresh_buffer(shape, shared=in_worker), False
        try:
            result = self.read_rows(array, out=images.numpy(), encoded=encoded)
        except BaseException:
            if recycled:
                release(images)  # on_error="raise": the batch is never handed out
            raise
        cols = self.index.columns
        slide_id = np.asarray(cols["slide_id"][array], dtype=np.int64)
        batch = TileBatch(
            images=images,
            ok=torch.tensor(result.ok),
            substituted=torch.tensor(result.substituted),
            rows=torch.tensor(array),
            slide_id=torch.tensor(slide_id),
            x=torch.tensor(np.asarray(cols["l0_x"][array], dtype=np.int64)),
            y=torch.tensor(np.asarray(cols["l0_y"][array], dtype=np.int64)),
            label=torch.tensor(self.slide_labels[slide_id]),
            recycled=recycled,
        )
        if recycled and in_worker:
            batch.lease_on_arrival()  # the receiving process leases it when it unpickles it
        elif recycled:
            batch.images = lease(images)
        if result.encoded is not None and any(e is not None for e in result.encoded):
            batch.encoded = result.encoded
            batch.slide_paths = [self.index.slides[int(i)].path for i in slide_id]
            batch.quarantine = str(self.index.path / "quarantine.jsonl")
        return batch
