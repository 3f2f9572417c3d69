"""Deep Zoom tiles made by this library's readers, on a bounded pool of threads.

A tile that is exactly a stored JPEG tile is sent as its stored bytes (the shared tables spliced
in: `ReadsStoredJpeg`), with no decode and no encode. Any other tile is a window of the coarsest
slide level fine enough, shrunk by libjpeg's DCT scaling where the factor is 2, 4 or 8
(`ReadsScaled`) and encoded once with libjpeg-turbo; coarse levels of a slide without a
pyramid come from its overview image or from the four finer tiles. Encoded tiles are kept in
a byte-bounded LRU, so a tile is made once however many clients ask for it.

Readers are not thread-safe: each thread of the pool has its own `HandlePool` (and with it
its own OpenSlide and decoded-segment caches); the caches of encoded tiles and of pixels are
shared, behind locks. A slide whose pixels cannot be read gives grey tiles with a red cross
(never cached) and is counted, so the page can say so; a tile across a stored tile that
cannot be decoded is grey only there (the rest of its window is read piece by piece).
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import simplejpeg
from PIL import Image

from wsi_loader.errors import SlideError, TileReadError
from wsi_loader.index._tissue import read_mask_image
from wsi_loader.slides._base import (
    BytesLRU,
    ReadsScaled,
    ReadsStoredJpeg,
    RGBArray,
    level_to_l0,
    resize,
    supports,
)
from wsi_loader.slides._pool import HandlePool
from wsi_loader.view.browser._geometry import DeepZoom, Plan, Source
from wsi_loader.view.browser._public import told

log = logging.getLogger(__name__)

Value = TypeVar("Value")
ERROR_GREY = 160  # the fill of tiles that could not be read
ERROR_MARK = (200, 30, 30)  # ... and the cross drawn over them
DEFAULT_TILE_SIZE = 256  # for slides without square storage tiles
TILE_SIZE_RANGE = (64, 2048)  # storage tiles outside this are not used as the Deep Zoom size


class SharedLRU(Generic[Value]):
    """A `BytesLRU` several threads share (one lock around it)."""

    def __init__(self, max_bytes: int, size: Callable[[Value], int]) -> None:
        self._lru: BytesLRU[Value] = BytesLRU(max_bytes, size)
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Value | None:
        with self._lock:
            return self._lru.get(key)

    def put(self, key: Hashable, value: Value) -> None:
        with self._lock:
            self._lru.put(key, value)

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._lru.nbytes


@dataclass(frozen=True)
class SlideRef:
    """What the tile maker needs of a slide: its id, where it is, and which version of the
    file is there (part of every cache key, so a replaced slide never shows old tiles)."""

    slide_id: int
    path: str
    version: str
    width: int  # level-0 size as indexed (the layout of a slide that cannot be opened)
    height: int


@dataclass
class Tile:
    """An encoded tile: its bytes, and why it is a grey error tile (None when it is not)."""

    body: bytes
    error: str | None = None
    passed_through: bool = False  # the stored bytes, not decoded and encoded again


@dataclass
class SlideFaults:
    """Reads that failed on one slide since the server started (``last``: the reason the page
    is given for the latest)."""

    count: int = 0
    last: str | None = None


@dataclass(frozen=True)
class TileOptions:
    """How tiles are made: ``tile_size`` (None: each slide's storage tile size, so stored tiles
    pass through), JPEG ``quality`` of re-encoded tiles, ``cache_mb`` of encoded tiles kept,
    ``threads`` reading (None: the usable cores, at least 2), reader ``backend``,
    ``max_open`` slides open per thread."""

    tile_size: int | None = None
    quality: int = 75
    cache_mb: int = 256
    threads: int | None = None
    backend: str = "auto"
    max_open: int = 8

    def __post_init__(self) -> None:
        low, high = TILE_SIZE_RANGE
        if self.tile_size is not None and not low <= self.tile_size <= high:
            raise ValueError(f"tile_size must be between {low} and {high}, got {self.tile_size}")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"quality must be between 1 and 100, got {self.quality}")
        if self.cache_mb < 0:
            raise ValueError(f"cache_mb must be >= 0, got {self.cache_mb}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {self.max_open}")

    @property
    def thread_count(self) -> int:
        if self.threads is not None:
            return self.threads
        return max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)


def encode_jpeg(pixels: RGBArray, quality: int) -> bytes:
    """Baseline JPEG, 4:2:0 (what scanners store and PIL writes by default)."""
    data: bytes = simplejpeg.encode_jpeg(
        np.ascontiguousarray(pixels), quality=quality, colorspace="RGB", colorsubsampling="420"
    )
    return data


def encode_png(pixels: np.ndarray[Any, Any]) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", compress_level=3)
    return buffer.getvalue()


def error_pixels(width: int, height: int) -> RGBArray:
    """A grey tile with a red cross: pixels that could not be read, visibly so."""
    out = np.full((height, width, 3), ERROR_GREY, dtype=np.uint8)
    thickness = max(1, min(width, height) // 64)
    for offset in range(-thickness, thickness + 1):
        xs = np.arange(width)
        ys = np.round(xs * (height - 1) / max(width - 1, 1)).astype(int) + offset
        keep = (ys >= 0) & (ys < height)
        out[ys[keep], xs[keep]] = ERROR_MARK
        out[ys[keep], width - 1 - xs[keep]] = ERROR_MARK
    return out


def halve(pixels: RGBArray) -> RGBArray:
    """The picture at half size (2 x 2 means; an odd last row or column averaged alone)."""
    h, w = pixels.shape[:2]
    padded = np.pad(pixels, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge").astype(np.uint16)
    total = padded[0::2, 0::2] + padded[1::2, 0::2] + padded[0::2, 1::2] + padded[1::2, 1::2]
    return ((total + 2) // 4).astype(np.uint8)


@dataclass
class _ThreadState:
    pool: HandlePool
    versions: dict[str, str] = field(default_factory=dict)  # path -> version its reader is


class TileMaker:
    """Makes Deep Zoom tiles (and other pixels the viewer asks for) of slides; every method
    that reads runs on the calling thread; `submit` runs one on the bounded pool."""

    def __init__(self, options: TileOptions | None = None, overview_size: int = 2048) -> None:
        self.options = options or TileOptions()
        self.overview_size = overview_size  # longest side of a flat slide's overview image
        self.executor = ThreadPoolExecutor(self.options.thread_count, thread_name_prefix="wsi-tile")
        self.tiles: SharedLRU[bytes] = SharedLRU(self.options.cache_mb * 2**20, len)
        self.pixels: SharedLRU[RGBArray] = SharedLRU(64 * 2**20, lambda a: a.nbytes)
        # (slide id, version) -> the pyramid, and why the slide could not be opened
        self._layouts: dict[tuple[int, str], tuple[DeepZoom, str | None]] = {}
        self._faults: dict[int, SlideFaults] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pools: list[HandlePool] = []
        self.passed_through = 0  # tiles sent as stored (for tests and the benchmark)

    # -- threads and readers -----------------------------------------------------------------
    def _new_pool(self) -> HandlePool:
        # small caches: every thread has its own
        pool = HandlePool(max_open=self.options.max_open, openslide_cache_bytes=16 * 2**20)
        with self._lock:
            self._pools.append(pool)
        return pool

    def _state(self) -> _ThreadState:
        state: _ThreadState | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState(self._new_pool())
        return state

    def reader(self, slide: SlideRef) -> Any:
        """This thread's open reader of ``slide`` (raises `SlideError`)."""
        state = self._state()
        if state.versions.get(slide.path, slide.version) != slide.version:
            # the file was replaced: its reader, and the decoded segments the pool's cache
            # keeps by path, are of the old file; start this thread's pool afresh (rare)
            state.pool.close()
            with self._lock:
                self._pools.remove(state.pool)
            state.pool = self._new_pool()
            state.versions.clear()
        state.versions[slide.path] = slide.version
        return state.pool.get(slide.path, self.options.backend)

    def close(self) -> None:
        """Stop the threads and close every reader."""
        self.executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pools, self._pools = self._pools, []
        for pool in pools:
            pool.close()

    # -- faults ------------------------------------------------------------------------------
    def _fault(self, slide: SlideRef, error: Exception) -> str:
        """Count a failed read; the reason the page is given (the full text is logged)."""
        reason = told(error, slide.slide_id, "read failed")
        with self._lock:
            faults = self._faults.setdefault(slide.slide_id, SlideFaults())
            faults.count += 1
            faults.last = reason
        return reason

    def faults(self, slide_id: int) -> SlideFaults:
        with self._lock:
            found = self._faults.get(slide_id)
            return SlideFaults(found.count, found.last) if found else SlideFaults()

    # -- layout ------------------------------------------------------------------------------
    def layout(self, slide: SlideRef) -> tuple[DeepZoom, str | None]:
        """The slide's Deep Zoom pyramid, and why it could not be opened (then the pyramid of
        its indexed size, whose tiles are all grey)."""
        key = (slide.slide_id, slide.version)
        with self._lock:
            known = self._layouts.get(key)
        if known is not None:
            return known
        try:
            meta = self.reader(slide).meta
        except SlideError as exc:  # kept too: a store that does not answer is asked once
            reason = self._fault(slide, exc)
            width, height = max(slide.width, 1), max(slide.height, 1)
            size = self.options.tile_size or DEFAULT_TILE_SIZE
            failed = (DeepZoom(width, height, size, ((width, height),), (1.0,)), reason)
            with self._lock:
                self._layouts[key] = failed
            return failed
        width, height = meta.dimensions
        layout = DeepZoom(
            width,
            height,
            self.options.tile_size or self._storage_tile_size(meta.tile_sizes),
            meta.level_dimensions,
            meta.level_downsamples,
            meta.tile_sizes,
            self.overview_size,
        )
        with self._lock:
            self._layouts[key] = (layout, None)
        return layout, None

    @staticmethod
    def _storage_tile_size(tile_sizes: tuple[tuple[int, int], ...]) -> int:
        """Level 0's storage tile edge when it is square and of a sensible size (so stored tiles
        pass through), else `DEFAULT_TILE_SIZE`."""
        low, high = TILE_SIZE_RANGE
        if tile_sizes and tile_sizes[0][0] == tile_sizes[0][1] and low <= tile_sizes[0][0] <= high:
            return tile_sizes[0][0]
        return DEFAULT_TILE_SIZE

    # -- tiles -------------------------------------------------------------------------------
    def tile(self, slide: SlideRef, z: int, col: int, row: int) -> Tile:
        """Tile ``(z, col, row)`` of ``slide`` as JPEG (which must exist: checked by the caller
        with the layout's `DeepZoom.has_tile`)."""
        key = (slide.slide_id, slide.version, z, col, row)
        cached = self.tiles.get(key)
        if cached is not None:
            return Tile(cached)
        layout, problem = self.layout(slide)
        if problem is not None:
            plan = layout.plan(z, col, row)
            return Tile(encode_jpeg(error_pixels(plan.z_w, plan.z_h), 90), problem)
        plan = layout.plan(z, col, row)
        failed: list[SlideError] = []
        try:
            if plan.stored:
                stored = self._stored(slide, plan)
                if stored is not None:
                    self.tiles.put(key, stored)
                    with self._lock:
                        self.passed_through += 1
                    return Tile(stored, passed_through=True)
            body = encode_jpeg(self._pixels(slide, layout, plan, failed), self.options.quality)
        except SlideError as exc:
            reason = self._fault(slide, exc)
            return Tile(encode_jpeg(error_pixels(plan.z_w, plan.z_h), 90), reason)
        if failed:  # grey where a piece could not be read: never kept, said, counted
            return Tile(body, self._fault(slide, failed[0]))
        self.tiles.put(key, body)
        return Tile(body)

    def _stored(self, slide: SlideRef, plan: Plan) -> bytes | None:
        """The stored JPEG of a tile that is exactly one (tables spliced in), when its header
        reads as a JPEG of the tile's size; None otherwise (then it is decoded, and a broken
        tile is said as such instead of reaching the browser). A 2 us check: what lies past
        the header is the browser's to decode, as it is the decoder's in every other viewer."""
        reader = self.reader(slide)
        if not supports(reader, ReadsStoredJpeg):
            return None
        data = reader.read_stored_jpeg(plan.l0_x, plan.l0_y, plan.level, plan.l_w, plan.l_h)
        if data is None:
            return None
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            return None
        return data if (width, height) == (plan.z_w, plan.z_h) else None

    def _window(
        self, slide: SlideRef, level: int, l0_x: int, l0_y: int, size: tuple[int, int, int, int]
    ) -> RGBArray:
        """A window of ``level`` (``size``: its width and height there, then the width and
        height to shrink it to); raises `SlideError`."""
        reader = self.reader(slide)
        l_w, l_h, z_w, z_h = size
        args = (l0_x, l0_y, level, l_w, l_h)
        if (l_w, l_h) == (z_w, z_h):
            pixels: RGBArray = reader.read_region(*args)
            return pixels
        if supports(reader, ReadsScaled):
            return reader.read_region_scaled(*args, z_w, z_h)
        return resize(reader.read_region(*args), z_w, z_h)

    def _pieces(
        self, slide: SlideRef, layout: DeepZoom, plan: Plan, failed: list[SlideError]
    ) -> RGBArray:
        """A tile whose window failed to read, made piece by piece (`DeepZoom.pieces`): the
        pieces that fail are grey with a cross, and their errors appended to ``failed``."""
        out = np.empty((plan.z_h, plan.z_w, 3), dtype=np.uint8)
        ds = layout.level_downsamples[plan.level]
        for x, y, w, h, zx0, zy0, zx1, zy1 in layout.pieces(plan):
            size = (w, h, zx1 - zx0, zy1 - zy0)
            try:
                piece = self._window(
                    slide, plan.level, level_to_l0(x, ds), level_to_l0(y, ds), size
                )
            except TileReadError as exc:
                failed.append(exc)
                piece = error_pixels(zx1 - zx0, zy1 - zy0)
            out[zy0:zy1, zx0:zx1] = piece
        return out

    def _pixels(
        self, slide: SlideRef, layout: DeepZoom, plan: Plan, failed: list[SlideError]
    ) -> RGBArray:
        """The pixels of a tile; where a region of the slide cannot be decoded they are grey
        (its error appended to ``failed``); raises `SlideError` when the slide cannot be read
        at all."""
        if plan.source is Source.SLIDE:
            window = (plan.l_w, plan.l_h, plan.z_w, plan.z_h)
            try:
                return self._window(slide, plan.level, plan.l0_x, plan.l0_y, window)
            except TileReadError:  # a broken stored tile: grey it alone
                return self._pieces(slide, layout, plan, failed)
        if plan.source is Source.OVERVIEW:
            overview = self.overview(slide, layout.overview_size)
            height, width = overview.shape[:2]
            box = layout.overview_box(plan, width, height)
            picture = Image.fromarray(overview).resize(
                (plan.z_w, plan.z_h), Image.Resampling.BILINEAR, box=box
            )
            return np.asarray(picture)
        # CHILDREN: four tiles of the next level (made, or kept from earlier), halved
        key = ("pixels", slide.slide_id, slide.version, plan.z, plan.col, plan.row)
        cached = self.pixels.get(key)
        if cached is not None:
            return cached
        size = layout.tile_size
        canvas = np.full((2 * size, 2 * size, 3), 255, dtype=np.uint8)
        before = len(failed)
        for col, row, x, y in layout.children(plan):
            child = self._pixels(slide, layout, layout.plan(plan.z + 1, col, row), failed)
            canvas[y : y + child.shape[0], x : x + child.shape[1]] = child
        pixels = halve(canvas)[: plan.z_h, : plan.z_w]
        if len(failed) == before:  # grey parts are not kept: asked again once fixed
            self.pixels.put(key, pixels)
        return pixels

    def overview(self, slide: SlideRef, max_size: int) -> RGBArray:
        """The whole slide at most ``max_size`` px on its longest side, from its coarsest
        level (cached); areas that cannot be read are grey."""
        key = ("overview", slide.slide_id, slide.version, max_size)
        cached = self.pixels.get(key)
        if cached is not None:
            return cached
        unreadable: list[tuple[int, int, int, int]] = []
        image, _ = read_mask_image(self.reader(slide), max_size, None, unreadable)
        for x0, y0, x1, y1 in unreadable:
            image[y0:y1, x0:x1] = ERROR_GREY
        self.pixels.put(key, image)
        return image

    def region(
        self, slide: SlideRef, l0_x: int, l0_y: int, level: int, size: int, out_size: int
    ) -> RGBArray:
        """A square window read as the dataset reads a tile (``size`` level pixels shrunk to
        ``out_size``); raises `SlideError`."""
        reader = self.reader(slide)
        if size == out_size:
            pixels: RGBArray = reader.read_region(l0_x, l0_y, level, size, size)
            return pixels
        if supports(reader, ReadsScaled):
            return reader.read_region_scaled(l0_x, l0_y, level, size, size, out_size, out_size)
        return resize(reader.read_region(l0_x, l0_y, level, size, size), out_size, out_size)


__all__ = [
    "SlideRef",
    "Tile",
    "TileMaker",
    "TileOptions",
    "encode_jpeg",
    "encode_png",
    "error_pixels",
]
