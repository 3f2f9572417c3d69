"""The batches of a whole-slide pass (features, predict): every tile of each slide, read so that
each storage tile is decoded once.

Readers keep decoded storage tiles in a per-process cache bounded in bytes (the raw reader's
`SegmentCache`, OpenSlide's own), so windows that share a storage tile (a 224 px grid over
256 px storage tiles, an overlapping grid) share its decode, as long as the tile is still
cached when its second window is read and that window is read by the same process. Index order
defeats both:

- rows go left to right across the whole slide, so the tiles a window row shares with the next
  row are a whole slide width back: on a slide wider than the cache holds (a 50,000 px row of
  256 px tiles is 38 MB of pixels, two rows 77 MB against 64 MB) they are evicted and decoded
  again;
- batch ``k`` goes to worker ``k % workers``, so neighbouring batches, which share storage
  tiles, are decoded by different processes.

So each slide's rows are read in vertical strips (a strip's width chosen so that the storage
rows its windows span fit the cache), cut into batches, and the batches are handed out in
contiguous runs, one run per worker: a storage tile is decoded again only where strips or runs
meet. The batches of a slide depend on the slide and the batch size only (not on the number of
workers, nor on which other slides are read), so a slide's outputs are the same whether it is
read alone or with others.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from wsi_loader.index._table import SlideIndex

CACHE_BYTES = 32 * 2**20  # half the default per-process cache of decoded storage tiles
LARGEST_STORAGE_TILE = 512  # px: windows span up to two storage rows of this height
MIN_STRIP_WINDOWS = 4


def strip_windows(read_size: int, cache_bytes: int = CACHE_BYTES) -> int:
    """Windows across a strip, so that the storage rows a strip's window row spans (the window
    height plus two storage tiles, at 3 bytes a pixel) fit in ``cache_bytes``."""
    per_window = read_size * 3 * (read_size + 2 * LARGEST_STORAGE_TILE)
    return max(MIN_STRIP_WINDOWS, cache_bytes // max(1, per_window))


def scan_order(
    index: SlideIndex, slide_id: int, cache_bytes: int = CACHE_BYTES
) -> npt.NDArray[np.int64]:
    """The rows of one slide in strip order: by strip, then top to bottom, then left to right."""
    starts = index.slide_starts()
    rows = np.arange(int(starts[slide_id]), int(starts[slide_id + 1]), dtype=np.int64)
    if len(rows) < 2:
        return rows
    cols = index.columns
    x = np.asarray(cols["l0_x"][rows], dtype=np.int64)
    y = np.asarray(cols["l0_y"][rows], dtype=np.int64)
    record = index.slides[slide_id]
    read_size = int(record.read_size or int(cols["read_size"][rows[0]]) or 1)
    footprint = max(1.0, read_size * float(record.read_downsample or 1.0))  # level-0 px
    strip = (x - int(x.min())) // int(footprint * strip_windows(read_size, cache_bytes))
    return rows[np.lexsort((x, y, strip))]


def slide_batches(
    index: SlideIndex,
    slide_ids: Sequence[int],
    batch_size: int,
    workers: int,
    cache_bytes: int = CACHE_BYTES,
) -> list[list[int]]:
    """The batches of ``slide_ids``, slide after slide, in the order to hand them out: each
    slide's batches (strip order, never mixing slides) are split into ``workers`` contiguous
    runs, and the runs interleaved, so that worker ``w`` reads run ``w``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    streams = max(1, workers)
    out: list[list[int]] = []
    for sid in slide_ids:
        rows = scan_order(index, sid, cache_bytes).tolist()
        batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
        runs = [part.tolist() for part in np.array_split(np.arange(len(batches)), streams)]
        for step in range(max((len(r) for r in runs), default=0)):
            out.extend(batches[run[step]] for run in runs if step < len(run))
    return out
