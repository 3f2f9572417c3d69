"""A bounded, per-process pool of open slide readers.

Handles are opened lazily in the process that reads. The pool remembers the pid that opened
them: after a fork the child sees a different pid and starts empty (the parent's handles are
dropped, never used or closed by the child). Least recently used handles are closed when the
pool is full (raw readers keep their parsed layout for a cheap reopen), broken handles
(OpenSlide errors latch) are closed on release, and everything is closed at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import resource
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import openslide

from wsi_loader.slides._base import BytesLRU, KeepsLayout, SlideReader, supports
from wsi_loader.slides._open import open_slide
from wsi_loader.slides._segment_cache import SegmentCache
from wsi_loader.slides.storage._local_copies import DEFAULT_FOLDER, DEFAULT_MAX_BYTES, LocalCopies
from wsi_loader.slides.storage._range_cache import DEFAULT_DEADLINE_S
from wsi_loader.slides.storage._sources import RangeStore

log = logging.getLogger(__name__)

_live_pools: weakref.WeakSet[HandlePool] = weakref.WeakSet()


Key = tuple[str, str]  # (path, backend)


class HandlePool:
    """LRU pool of readers keyed by (path, backend), valid only in the process that opened them.

    ``max_open`` bounds the open files. ``openslide_cache_bytes`` sizes one
    `openslide.OpenSlideCache` shared by every OpenSlide handle of this process, and one
    `SegmentCache` of decoded raw tiles shared by every raw handle, so memory does not grow
    with the number of open handles.

    Raw (tifffile) readers evicted from the open set keep their parsed layout, up to
    ``layout_cache_bytes`` in all (LRU; ~16 bytes per storage tile, so 64 MiB covers
    hundreds of slides): reopening one is an ``open`` call instead of a parse of the TIFF.
    That is what keeps a batch sampled at random from an archive of many more slides than
    ``max_open`` fast (each batch touches most of its slides). OpenSlide handles cannot be kept
    that way: for archives of OpenSlide-read slides, raise ``max_open`` or sample slide-grouped
    (`DistributedTileSampler(slide_window=...)`).

    Remote slides (URLs): ``prefetch_bytes`` bounds the byte ranges fetched ahead of the
    reads, and kept for later reads, in this process (a `RangeStore`); slides only OpenSlide
    reads are copied into ``remote_cache_dir``, at most ``remote_cache_bytes`` (shared by the
    machine's processes). A request to a store that gives no answer within
    ``remote_timeout_s`` fails the read as a transient error.
    """

    def __init__(
        self,
        max_open: int = 16,
        openslide_cache_bytes: int = 64 * 2**20,
        layout_cache_bytes: int = 64 * 2**20,
        prefetch_bytes: int = 256 * 2**20,
        remote_cache_dir: str = DEFAULT_FOLDER,
        remote_cache_bytes: int = DEFAULT_MAX_BYTES,
        remote_timeout_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        if openslide_cache_bytes < 0:
            raise ValueError(f"openslide_cache_bytes must be >= 0, got {openslide_cache_bytes}")
        if layout_cache_bytes < 0:
            raise ValueError(f"layout_cache_bytes must be >= 0, got {layout_cache_bytes}")
        if prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes must be >= 0, got {prefetch_bytes}")
        self.max_open = max_open
        self.openslide_cache_bytes = openslide_cache_bytes
        self.layout_cache_bytes = layout_cache_bytes
        self.prefetch_bytes = prefetch_bytes
        if not remote_timeout_s > 0:
            raise ValueError(f"remote_timeout_s must be > 0, got {remote_timeout_s}")
        self.remote_timeout_s = float(remote_timeout_s)
        self.copies = LocalCopies(remote_cache_dir, remote_cache_bytes)
        self._pid = -1
        self._reset()
        _live_pools.add(self)

    def _reset(self) -> None:
        """Forget every reader (a new pool, or one inherited by a forked child)."""
        self._readers: OrderedDict[Key, SlideReader] = OrderedDict()
        self._cache: openslide.OpenSlideCache | None = None
        self._segments: SegmentCache | None = None
        self._holding = False
        self._retired: dict[Key, SlideReader] = {}  # evicted while holding: closed when it ends
        # closed readers whose layout is kept, each with its KeepsLayout side
        self._parked: BytesLRU[tuple[SlideReader, KeepsLayout]] = BytesLRU(
            self.layout_cache_bytes, size=lambda parked: parked[1].layout_bytes()
        )
        self.store = RangeStore(
            self.prefetch_bytes, self.remote_timeout_s
        )  # remote byte ranges fetched ahead
        self.opened = 0  # slides opened (parsed) by this process (for tests and stats)
        self.reopened = 0  # closed raw readers reopened with their kept layout

    def __getstate__(self) -> dict[str, float | str]:
        """Pickle the options only: handles never cross a process boundary."""
        return {
            "max_open": self.max_open,
            "openslide_cache_bytes": self.openslide_cache_bytes,
            "layout_cache_bytes": self.layout_cache_bytes,
            "prefetch_bytes": self.prefetch_bytes,
            "remote_cache_dir": self.copies.folder,
            "remote_cache_bytes": self.copies.max_bytes,
            "remote_timeout_s": self.remote_timeout_s,
        }

    def __setstate__(self, state: dict[str, float | str]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def _check_process(self) -> None:
        pid = os.getpid()
        if pid != self._pid:
            # Inherited from another process (fork): forget, never touch, the parent's handles.
            self._reset()
            self._pid = pid
            self._open_limit = fitting_open_limit(self.max_open)

    @property
    def open_limit(self) -> int:
        """Readers kept open in this process: ``max_open``, lowered to fit the file limit."""
        self._check_process()
        return self._open_limit

    def get(
        self,
        path: str,
        backend: str = "auto",
        verify: Callable[[str], None] | None = None,
    ) -> SlideReader:
        """Return an open reader for ``path``, opening (and maybe evicting) as needed.

        ``verify(path)`` runs after each fresh open (not for open readers, nor for a kept
        layout reopened on an unchanged file: same device, inode, size and mtime) and may raise
        to refuse the file (a slide replaced since it was indexed)."""
        self._check_process()
        key = (path, backend)
        reader = self._readers.get(key)
        if reader is not None and not reader.broken:
            self._readers.move_to_end(key)
            return reader
        if reader is not None:
            self.discard(path, backend)
        reader = self._retired.pop(key, None)  # evicted in this holding block: still open
        if reader is None:
            reader = self._unpark(key)
        if reader is None:
            if self._cache is None and self.openslide_cache_bytes > 0:
                self._cache = openslide.OpenSlideCache(self.openslide_cache_bytes)
            if self._segments is None:
                self._segments = SegmentCache(self.openslide_cache_bytes)
            reader = open_slide(path, backend, self._cache, self._segments, self.store, self.copies)
            self.opened += 1
            if verify is not None:
                try:
                    verify(path)
                except BaseException:
                    reader.close()
                    raise
        self._readers[key] = reader
        while len(self._readers) > self._open_limit:
            old_key, old = self._readers.popitem(last=False)
            if self._holding:
                self._retired[old_key] = old
            else:
                self._close(old_key, old)
        return reader

    def peek(self, path: str, backend: str = "auto") -> SlideReader | None:
        """The open reader of ``path``, if any; opens nothing, evicts nothing."""
        self._check_process()
        reader = self._readers.get((path, backend))
        return None if reader is None or reader.broken else reader

    def _close(self, key: Key, reader: SlideReader) -> None:
        """Close an evicted reader; keep a raw reader's layout for a cheap reopen."""
        reader.close()
        keeper = reader
        if supports(keeper, KeepsLayout):
            self._parked.put(key, (reader, keeper))

    def _unpark(self, key: Key) -> SlideReader | None:
        parked = self._parked.pop(key)
        if parked is None:
            return None
        reader, keeper = parked
        if not keeper.reopen():  # the file changed or went: parse it again
            return None
        self.reopened += 1
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
            retired, self._retired = self._retired, {}
            for key, reader in retired.items():
                self._close(key, reader)

    def discard(self, path: str, backend: str = "auto") -> None:
        """Close and forget the reader for ``path`` (after an error: its state may be latched,
        or the file may have changed), its kept layout included."""
        self._check_process()
        key = (path, backend)
        self._parked.pop(key)
        reader = self._readers.pop(key, None)
        if reader is None:
            reader = self._retired.pop(key, None)
        if reader is not None:
            try:
                reader.close()
            except Exception as exc:  # a broken handle may fail to close; it is gone either way
                log.debug("closing %s failed: %s", path, exc)

    def __len__(self) -> int:
        """Open readers."""
        self._check_process()
        return len(self._readers)

    def close(self) -> None:
        """Close every handle this process opened and drop the kept layouts."""
        if self._pid != os.getpid():
            self._reset()
            return
        self._parked.clear()
        while self._readers:
            _, reader = self._readers.popitem()
            reader.close()


FDS_PER_READER = 4  # an OpenSlide handle may hold several descriptors (the raw reader: one)
FDS_SPARE = 64  # for everything else the process opens (sockets, pipes, libraries)


def fitting_open_limit(max_open: int) -> int:
    """``max_open``, lowered (with a WARNING) when this process's file limit (``ulimit -n``)
    cannot hold that many readers: open failures for want of descriptors are not slide
    faults, and a DataLoader worker that runs out of them can stall its queue."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return max_open
    if soft == resource.RLIM_INFINITY:
        return max_open
    fitting = max(1, (soft - FDS_SPARE) // FDS_PER_READER)
    if fitting < max_open:
        log.warning(
            "max_open_slides=%d does not fit the file limit of this process (ulimit -n %d): "
            "keeping at most %d slides open",
            max_open,
            soft,
            fitting,
        )
        return fitting
    return max_open


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_live_pools):
        pool.close()
