"""Slide readers, the first step: one protocol, two backends, a per-process pool, and the
bytes below them.

- `_base`: the reader protocol and its optional capabilities (small Protocols checked with
  `supports`), `SlideMeta`, resizing, a byte-bounded LRU
- `_open`: `open_slide`, which picks the backend for a file
- `_openslide`: OpenSlide, the universal reader (every vendor format) and the reference for pixels
- the raw path, reading compressed tiles at tifffile's offsets: `_tiff` (the reader),
  `_tiff_decode` (a level's segments decoded by libjpeg-turbo, with DCT scaling), `_tiff_meta`
  (MPP and vendor metadata from tags), `_tiff_files` (the files tifffile parses) and
  `_segment_cache` (the per-process cache of decoded segments)
- `_pool`: `HandlePool`, a bounded pool of open readers per process (never pickled; a reader
  that failed is closed, since OpenSlide's errors latch)
- `storage/`: where the bytes come from (local files, object stores, HTTP): ranges, caches,
  local copies

May import: the foundation modules only. Never imports torch.
"""

from wsi_loader.slides._base import SlideMeta, SlideReader
from wsi_loader.slides._open import BACKENDS, open_slide
from wsi_loader.slides._pool import HandlePool

__all__ = ["BACKENDS", "HandlePool", "SlideMeta", "SlideReader", "open_slide"]
