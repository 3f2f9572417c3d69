"""A bounded, per-process pool of open slide readers.

Handles are opened lazily in the process that reads. The pool remembers the pid that opened
them: after a fork the child sees a different pid and starts empty (the parent's handles are
dropped, never used or closed by the child). Least recently used handles are closed when the
pool is full, broken handles (OpenSlide errors latch) are closed on release, and everything is
closed at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import openslide

from wsi_loader.slides.base import SlideReader
from wsi_loader.slides.open import open_slide
from wsi_loader.slides.tiff_backend import SegmentCache

log = logging.getLogger(__name__)

_live_pools: weakref.WeakSet[HandlePool] = weakref.WeakSet()


class HandlePool:
    """LRU pool of readers keyed by (path, backend), valid only in the process that opened them.

    ``openslide_cache_bytes`` sizes one `openslide.OpenSlideCache` shared by every OpenSlide
    handle of this process, and one `SegmentCache` of decoded raw tiles shared by every raw
    handle, so memory does not grow with the number of open handles.
    """

    def __init__(self, max_open: int = 16, openslide_cache_bytes: int = 64 * 2**20) -> None:
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        if openslide_cache_bytes < 0:
            raise ValueError(f"openslide_cache_bytes must be >= 0, got {openslide_cache_bytes}")
        self.max_open = max_open
        self.openslide_cache_bytes = openslide_cache_bytes
        self._pid = -1
        self._readers: OrderedDict[tuple[str, str], SlideReader] = OrderedDict()
        self._cache: openslide.OpenSlideCache | None = None
        self._segments: SegmentCache | None = None
        self._holding = False
        self._retired: list[SlideReader] = []  # evicted while holding: closed when it ends
        self.opened = 0  # handles opened by this process (for tests and stats)
        _live_pools.add(self)

    def __getstate__(self) -> dict[str, int]:
        """Pickle the options only: handles never cross a process boundary."""
        return {"max_open": self.max_open, "openslide_cache_bytes": self.openslide_cache_bytes}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def _check_process(self) -> None:
        pid = os.getpid()
        if pid != self._pid:
            # Inherited from another process (fork): forget, never touch, the parent's handles.
            self._readers = OrderedDict()
            self._cache = None
            self._segments = None
            self._retired = []
            self._pid = pid
            self.opened = 0

    def get(self, path: str, backend: str = "auto") -> SlideReader:
        """Return an open reader for ``path``, opening (and maybe evicting) as needed."""
        self._check_process()
        key = (path, backend)
        reader = self._readers.get(key)
        if reader is not None and not getattr(reader, "broken", False):
            self._readers.move_to_end(key)
            return reader
        if reader is not None:
            self.discard(path, backend)
        if self._cache is None and self.openslide_cache_bytes > 0:
            self._cache = openslide.OpenSlideCache(self.openslide_cache_bytes)
        if self._segments is None:
            self._segments = SegmentCache(self.openslide_cache_bytes)
        reader = open_slide(path, backend, self._cache, self._segments)
        self.opened += 1
        self._readers[key] = reader
        while len(self._readers) > self.max_open:
            _, old = self._readers.popitem(last=False)
            if self._holding:
                self._retired.append(old)
            else:
                old.close()
        return reader

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Readers evicted inside the block stay open until it ends: work planned on them in
        the block (reads on other threads) may still use them. A batch that spans more slides
        than ``max_open`` keeps at most one handle per slide of the batch open meanwhile."""
        self._check_process()
        if self._holding:
            raise RuntimeError("HandlePool.holding() does not nest")
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            retired, self._retired = self._retired, []
            for reader in retired:
                reader.close()

    def discard(self, path: str, backend: str = "auto") -> None:
        """Close and forget the reader for ``path`` (after an error: its state may be latched)."""
        self._check_process()
        reader = self._readers.pop((path, backend), None)
        if reader is not None:
            try:
                reader.close()
            except Exception as exc:  # a broken handle may fail to close; it is gone either way
                log.debug("closing %s failed: %s", path, exc)

    def __len__(self) -> int:
        self._check_process()
        return len(self._readers)

    def close(self) -> None:
        """Close every handle this process opened."""
        if self._pid != os.getpid():
            self._readers = OrderedDict()
            return
        while self._readers:
            _, reader = self._readers.popitem()
            reader.close()


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_live_pools):
        pool.close()
