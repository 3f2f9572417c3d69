"""tifffile backend: reads TIFF-family slides segment by segment, without OpenSlide.

It opens TIFFs that OpenSlide rejects (plain strip TIFFs, QPTIFF) and reads tiled TIFFs by
fetching the compressed storage tiles a window covers and decoding only those (JPEG with
shared tables by libjpeg-turbo through simplejpeg, strict about corrupt data as OpenSlide is;
JPEG 2000, deflate, LZW, ZSTD... by imagecodecs through tifffile). Its errors do not latch: a
corrupt tile raises `TileReadError` and the next read works.

This module holds the reader: opening and parsing, window reads and their stitching, the
decodes planned ahead, the stored bytes, and reopening. `_tiff_decode` holds one level's
geometry and decoders, `_tiff_meta` the metadata read from the tags, `_tiff_files` the file
tifffile parses, and `_segment_cache` the cache of decoded segments the readers share.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Container
from typing import Any

import numpy as np
import tifffile

from wsi_loader.errors import (
    SlideOpenError,
    TileReadError,
    WsiLoaderError,
    describe,
)
from wsi_loader.slides._base import (
    RGBArray,
    SegmentJob,
    SegmentKey,
    SlideReader,
    StoredSizes,
    Window,
    closed_error,
    l0_to_level,
    open_regular,
    resize,
)
from wsi_loader.slides._segment_cache import SegmentCache
from wsi_loader.slides._tiff_decode import (
    DATA_ERRORS,
    DCT_SCALES,
    JPEG,
    MINISBLACK,
    OLD_JPEG,
    RAW_COMPRESSIONS,
    RGB,
    UNCOMPRESSED,
    YCBCR,
    Level,
    to_rgb,
)
from wsi_loader.slides._tiff_files import identity, named_file, open_local, parse_messages
from wsi_loader.slides._tiff_meta import read_meta
from wsi_loader.slides.storage._sources import Range, RangeStore, RemoteBytes, is_url, read_ahead

log = logging.getLogger(__name__)


def _said(messages: list[str], limit: int = 3) -> str:
    """tifffile's messages for an error text (the first few, each bounded)."""
    if not messages:
        return ""
    shown = "; ".join(m[:200] for m in messages[:limit])
    more = f" (and {len(messages) - limit} more)" if len(messages) > limit else ""
    return f" (tifffile said: {shown}{more})"


class TiffReader(SlideReader):
    """A `SlideReader` over tifffile, decoding only the storage segments a window covers.

    ``path`` may be a URL (``s3://``, ``gs://``, ``https://``): the header is parsed through
    a few block reads and tile bytes come by range requests through ``store`` (see
    `wsi_loader.slides.storage._sources`); a local file is read with ``pread``.
    """

    backend = "tiff"

    def __init__(
        self, path: str, cache: SegmentCache | None = None, store: RangeStore | None = None
    ) -> None:
        self.path = path
        self._fd = -1
        self._remote: RemoteBytes | None = None
        handle: Any = path
        with parse_messages.kept() as said:
            try:
                if is_url(path):
                    self._remote = RemoteBytes(path, store if store is not None else RangeStore())
                    handle = self._remote.open_for_parsing()
                else:  # our own descriptor (pread: no file position), lent to tifffile
                    self._fd = open_local(path)
                    handle = named_file(self._fd, path)
                self._parse(handle)
                self._refuse_undecodable_old_jpeg()
            except WsiLoaderError:
                self.close()
                raise  # a missing object, an unreachable store: said as it is
            except Exception as exc:  # tifffile raises many types for malformed input
                self.close()
                raise SlideOpenError(
                    f"tifffile: {type(exc).__name__}: {exc}{_said(said)}", path=path
                ) from exc
            finally:
                if handle is not path:
                    handle.close()
        if said:
            log.debug("parsing %s, tifffile said: %s", path, "; ".join(said))
        self.identity = identity(os.fstat(self._fd)) if self._remote is None else None
        self._closed = False
        self._cache = cache if cache is not None else SegmentCache()
        self._layout_bytes = sum(lv.nbytes for lv in self._levels)

    def _refuse_undecodable_old_jpeg(self) -> None:
        """Old-style JPEG (Compression 6) comes in variants; tifffile decodes those whose
        segments are whole JPEG streams. Any other indexed as ok and then failed every tile
        ("Not a JPEG file"): one segment is decoded now, and the file refused if it fails."""
        for number, lv in enumerate(self._levels):
            if lv.compression != OLD_JPEG or not len(lv.offsets):
                continue
            try:
                self._decoder(number, 0, 1)()
            except DATA_ERRORS as exc:
                raise SlideOpenError(
                    f"old-style JPEG (Compression 6) that cannot be decoded: {describe(exc)}",
                    path=self.path,
                ) from exc

    def _parse(self, handle: Any) -> None:
        """Read the levels' layout and the metadata; keep a descriptor of a local file."""
        with tifffile.TiffFile(handle) as tif:
            if not tif.series:
                raise ValueError("no image in the file (truncated, or a TIFF without images)")
            series = tif.series[0]
            candidates: list[object] = (
                list(tif.pages)  # SVS, as OpenSlide reads it: every tiled page is a level
                if series.kind == "svs"
                else [level.pages[0] for level in series.levels]
            )
            pages = [p for p in candidates if isinstance(p, tifffile.TiffPage)]
            if series.kind == "svs":
                pages = [p for p in pages if p.is_tiled]
            self._levels = [Level(page) for page in pages]
            ome = tif.ome_metadata if series.kind == "ome" else None
            self.meta = read_meta(self.backend, self._levels, series, pages[0], ome)

    def _level_xy(self, level: int, l0_x: int, l0_y: int) -> tuple[int, int]:
        """Level-0 coordinates to this level's pixels (`l0_to_level`, the grid's rule)."""
        ds = self.meta.level_downsamples[level]
        return l0_to_level(l0_x, ds), l0_to_level(l0_y, ds)

    def _whole_tile(self, level: int, l_x: int, l_y: int, l_w: int, l_h: int) -> int | None:
        """The segment index when the window is exactly one full storage tile, else None."""
        lv = self._levels[level]
        if (
            l_w == lv.seg_w
            and l_h == lv.seg_h
            and l_x >= 0
            and l_y >= 0
            and l_x % lv.seg_w == 0
            and l_y % lv.seg_h == 0
            and l_x + l_w <= lv.width
            and l_y + l_h <= lv.height
        ):
            return (l_y // lv.seg_h) * lv.across + l_x // lv.seg_w
        return None

    def _raw(self, level: int, index: int) -> bytes:
        lv = self._levels[level]
        # pread: one system call, no shared file position (tifffile's seek + read cost 3x more)
        count, offset = int(lv.counts[index]), int(lv.offsets[index])
        if self._remote is not None:
            data = self._remote.read(offset, count)
        else:
            data = os.pread(self._fd, count, offset)
        if len(data) != count or not data:
            raise ValueError(
                f"segment {index} of level {level} is truncated: "
                f"{len(data)} of {count} bytes (file shorter than its index)"
            )
        return data

    def _segment(self, level: int, index: int, scale: int = 1) -> RGBArray:
        """Decoded storage segment ``index`` of ``level``, DCT-scaled down by ``scale``."""
        key = (self.path, level, index, scale)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        pixels = self._decoder(level, index, scale)()
        self._cache.put(key, pixels)
        return pixels

    def _decoder(self, level: int, index: int, scale: int) -> Callable[[], RGBArray]:
        """Read segment ``index``'s bytes now; return the call that decodes them. It uses only
        those bytes and immutable level geometry, so any thread may run it."""
        lv = self._levels[level]
        data = self._raw(level, index)
        jpeg = lv.jpeg_colorspace is not None
        page_decode = lv.page_decode if scale == 1 else None
        if scale == 1 and not jpeg and page_decode is None:
            raise ValueError(f"cannot decode level {level}: {lv.page_decode_error}")

        def decode() -> RGBArray:
            if jpeg:  # DCT-scaled by libjpeg when scale > 1
                pixels: RGBArray = lv.decode_jpeg(data, scale=scale)
            else:
                assert page_decode is not None
                decoded, _, _ = page_decode(data, index, jpegtables=lv.tables)
                if decoded is None:
                    raise ValueError(f"segment {index} of level {level} is empty")
                # decoded is (depth, length, width, samples)
                pixels = to_rgb(decoded[0], lv.bits, lv.associated_alpha)
            pixels.flags.writeable = False  # shared through the cache: callers copy, never mutate
            return pixels

        return decode

    def _covering(self, level: int, l_x: int, l_y: int, l_w: int, l_h: int) -> list[int]:
        """Indices of the segments a window of ``level`` overlaps (none when it is outside)."""
        lv = self._levels[level]
        x0, y0 = max(l_x, 0), max(l_y, 0)
        x1, y1 = min(l_x + l_w, lv.width), min(l_y + l_h, lv.height)
        if x0 >= x1 or y0 >= y1:
            return []
        return [
            row * lv.across + col
            for row in range(y0 // lv.seg_h, (y1 - 1) // lv.seg_h + 1)
            for col in range(x0 // lv.seg_w, (x1 - 1) // lv.seg_w + 1)
        ]

    def _dct_scale(
        self, l_x: int, l_y: int, level: int, l_w: int, l_h: int, out_w: int, out_h: int
    ) -> int:
        """The scale a read shrinking ``l_w`` x ``l_h`` to ``out_w`` x ``out_h`` decodes at: 2, 4
        or 8 when libjpeg's DCT scaling does the shrinking exactly, else 1 (then resampled)."""
        lv = self._levels[level]
        scale = l_w // out_w if out_w else 0
        if (
            lv.dct_scalable
            and scale in DCT_SCALES
            and l_w == out_w * scale
            and l_h == out_h * scale
            and l_x % scale == 0
            and l_y % scale == 0
            and lv.seg_w % scale == 0
            and lv.seg_h % scale == 0
        ):
            return scale
        return 1

    def read_job(
        self, dest: RGBArray, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int
    ) -> Callable[[], None] | None:
        """For a window that is exactly one JPEG storage tile not in the cache: read its bytes
        now and return the call that decodes them straight into ``dest``. The call uses no
        state of this reader (no file, no cache), so another thread may run it while this one
        goes on; libjpeg releases the GIL. None for any other window (see `segment_jobs`)."""
        if self._closed:
            raise closed_error(self.path)
        try:
            index = self._whole_jpeg(dest, l0_x, l0_y, level, l_w, l_h)
            if index is None:
                return None
            data = self._raw(level, index)
        except DATA_ERRORS as exc:
            raise self._error(l0_x, l0_y, level, l_w, l_h, exc) from exc
        lv = self._levels[level]

        def decode() -> None:
            try:
                lv.decode_jpeg(data, out=dest)
            except DATA_ERRORS as exc:  # decoders raise codec-specific types
                raise self._error(l0_x, l0_y, level, l_w, l_h, exc) from exc

        return decode

    def _whole_jpeg(
        self, dest: RGBArray, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int
    ) -> int | None:
        """The segment index when the window is exactly one JPEG storage tile, not in the
        cache, that can be decoded straight into ``dest``; else None."""
        lv = self._levels[level]
        if lv.jpeg_colorspace is None or dest.shape != (l_h, l_w, 3) or not dest.flags.c_contiguous:
            return None
        if level == 0:  # (the common case: no rounding to do)
            index = self._whole_tile(0, l0_x, l0_y, l_w, l_h)
        else:
            index = self._whole_tile(level, *self._level_xy(level, l0_x, l0_y), l_w, l_h)
        if index is None or (self.path, level, index, 1) in self._cache:
            return None
        return index

    def segment_jobs(
        self,
        l0_x: int,
        l0_y: int,
        level: int,
        l_w: int,
        l_h: int,
        out_w: int,
        out_h: int,
        planned: Container[SegmentKey] = (),
    ) -> list[SegmentJob]:
        """The segment decodes a read of this window (shrunk to ``out_w`` x ``out_h``) would do
        because the cache lacks them and ``planned`` (the caller's jobs so far) does not hold
        them, with their bytes read now. Run them on any thread and `keep` the results: the
        read itself then only stitches cached segments."""
        if self._closed:
            raise closed_error(self.path)
        try:
            l_x, l_y = self._level_xy(level, l0_x, l0_y)
            scale = self._dct_scale(l_x, l_y, level, l_w, l_h, out_w, out_h)
            lv = self._levels[level]
            nbytes = -(-lv.seg_w // scale) * -(-lv.seg_h // scale) * 3
            return [
                SegmentJob(key, nbytes, self._decoder(level, index, scale))
                for index in self._covering(level, l_x, l_y, l_w, l_h)
                if (key := (self.path, level, index, scale)) not in self._cache
                and key not in planned
            ]
        except DATA_ERRORS as exc:
            raise self._error(l0_x, l0_y, level, l_w, l_h, exc) from exc

    def keep(self, key: SegmentKey, pixels: RGBArray) -> None:
        """Cache a segment decoded by a `segment_jobs` job (for the read that follows)."""
        self._cache.put(key, pixels, planned=True)

    def segment_cache_bytes(self) -> int:
        """Capacity of the segment cache this reader shares with its process's other readers."""
        return self._cache.max_bytes

    def read_region_into(
        self, dest: RGBArray, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int
    ) -> None:
        """`read_region` written into ``dest``; a window that is exactly one JPEG storage tile
        not in the cache is decoded straight into ``dest`` (no intermediate copy)."""
        if self._closed:
            raise closed_error(self.path)
        try:
            index = self._whole_jpeg(dest, l0_x, l0_y, level, l_w, l_h)
            if index is not None:
                self._levels[level].decode_jpeg(self._raw(level, index), out=dest)
            else:
                self._read_window(l0_x, l0_y, level, l_w, l_h, out=dest)
        except DATA_ERRORS as exc:  # decoders raise codec-specific types
            raise self._error(l0_x, l0_y, level, l_w, l_h, exc) from exc

    def read_region_scaled(
        self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int, out_w: int, out_h: int
    ) -> RGBArray:
        """Read a window and shrink it to ``out_w`` x ``out_h``.

        When the factor is 2, 4 or 8 and the window sits on the scaled grid, JPEG tiles are
        decoded at reduced size by libjpeg (DCT scaling, ~3x cheaper than decode-and-shrink);
        otherwise the window is read at full size and resampled (bilinear).
        """
        if self._closed:
            raise closed_error(self.path)
        try:
            l_x, l_y = self._level_xy(level, l0_x, l0_y)
            scale = self._dct_scale(l_x, l_y, level, l_w, l_h, out_w, out_h)
            pixels = self._read_window(l0_x, l0_y, level, l_w, l_h, scale)
        except DATA_ERRORS as exc:  # decoders raise codec-specific types
            raise self._error(l0_x, l0_y, level, l_w, l_h, exc) from exc
        return resize(pixels, out_w, out_h)

    def _error(
        self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int, exc: Exception
    ) -> TileReadError:
        return TileReadError.for_region(self.path, l0_x, l0_y, level, l_w, l_h, exc)

    def read_region(self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int) -> RGBArray:
        if self._closed:
            raise closed_error(self.path)
        try:
            return self._read_window(l0_x, l0_y, level, l_w, l_h)
        except DATA_ERRORS as exc:  # decoders raise codec-specific types
            raise self._error(l0_x, l0_y, level, l_w, l_h, exc) from exc

    def _read_window(
        self,
        l0_x: int,
        l0_y: int,
        level: int,
        l_w: int,
        l_h: int,
        scale: int = 1,
        out: RGBArray | None = None,
    ) -> RGBArray:
        """Stitch the (optionally DCT-scaled) segments covering a window; white outside.
        Into ``out`` when given (each pixel written once: a window inside the level is not
        filled white first), else into a new array (an aligned window at scale 1: the cached
        segment itself, no copy)."""
        lv = self._levels[level]
        l_x, l_y = self._level_xy(level, l0_x, l0_y)
        whole = self._whole_tile(level, l_x, l_y, l_w, l_h) if scale == 1 else None
        if whole is not None:
            if out is None:
                return self._segment(level, whole)
            out[...] = self._segment(level, whole)
            return out
        x0, y0 = max(l_x, 0), max(l_y, 0)
        x1, y1 = min(l_x + l_w, lv.width), min(l_y + l_h, lv.height)
        segments = [
            (index, self._segment(level, index, scale))
            for index in self._covering(level, l_x, l_y, l_w, l_h)
        ]
        if out is None:
            out = np.empty((l_h // scale, l_w // scale, 3), dtype=np.uint8)
        inside = (x0, y0, x1, y1) == (l_x, l_y, l_x + l_w, l_y + l_h)
        if not (inside and all(self._full(lv, seg, scale) for _, seg in segments)):
            out.fill(255)  # parts no segment covers stay white
        for index, seg in segments:
            sx, sy = (index % lv.across) * lv.seg_w, (index // lv.across) * lv.seg_h
            ax, ay = max(x0, sx), max(y0, sy)
            bx = min(x1, sx + lv.seg_w, sx + seg.shape[1] * scale)
            by = min(y1, sy + lv.seg_h, sy + seg.shape[0] * scale)
            if ax < bx and ay < by:
                out[
                    (ay - l_y) // scale : -(-(by - l_y) // scale),
                    (ax - l_x) // scale : -(-(bx - l_x) // scale),
                ] = seg[
                    (ay - sy) // scale : -(-(by - sy) // scale),
                    (ax - sx) // scale : -(-(bx - sx) // scale),
                ]
        return out

    @staticmethod
    def _full(lv: Level, seg: RGBArray, scale: int) -> bool:
        """Whether a decoded segment has the level's whole segment size (at ``scale``)."""
        return bool(seg.shape[0] * scale >= lv.seg_h and seg.shape[1] * scale >= lv.seg_w)

    def read_encoded(self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int) -> bytes | None:
        """The complete JPEG stream of a window that is exactly one YCbCr JPEG storage tile
        (tables spliced in), for decoding elsewhere (GPU); None when the window is not one."""
        if not self._levels[level].dct_scalable:
            return None
        return self.read_stored_jpeg(l0_x, l0_y, level, l_w, l_h)

    def read_stored_jpeg(
        self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int
    ) -> bytes | None:
        """`read_encoded` for RGB JPEG tiles too (Aperio's, with the Adobe marker saying they
        are RGB, which libjpeg-based decoders such as browsers honour; nvJPEG may not)."""
        if self._closed:
            raise closed_error(self.path)
        lv = self._levels[level]
        index = self._whole_tile(level, *self._level_xy(level, l0_x, l0_y), l_w, l_h)
        if index is None or lv.jpeg_colorspace is None:
            return None
        try:
            data = self._raw(level, index)
        except DATA_ERRORS as exc:
            raise self._error(l0_x, l0_y, level, l_w, l_h, exc) from exc
        return lv.complete_jpeg(data)

    def stored_sizes(self, level: int) -> StoredSizes | None:
        """Bytes of each storage tile of ``level`` (from the parsed layout; nothing is read),
        None when the level is stored uncompressed or in strips."""
        lv = self._levels[level]
        if (
            not lv.is_tiled
            or lv.compression == UNCOMPRESSED
            or len(lv.counts) != lv.across * lv.down
        ):
            return None
        return StoredSizes(lv.counts.reshape(lv.down, lv.across), lv.seg_w, lv.seg_h)

    def qualifies(self) -> bool:
        """Whether the auto backend reads this file with the raw path rather than OpenSlide:
        every level tiled, and either 8-bit colour in a codec both decode (the raw path is
        the faster, pixels alike) or 16-bit, whose partial edge tiles OpenSlide reads wrong."""
        return all(
            lv.is_tiled
            and (
                (lv.compression in RAW_COMPRESSIONS and lv.samples in (3, 4) and lv.bits == 8)
                or (lv.bits == 16 and self._decodes(lv))
            )
            for lv in self._levels
        )

    def decodes_every_level(self) -> bool:
        """Whether the raw path reads every level (its codec decoded by libjpeg-turbo or
        tifffile/imagecodecs, its samples grey or RGB): the reader for a file OpenSlide cannot
        open (PNG, LZMA, LERC, JPEG XR, JPEG XL... tiles)."""
        return all(self._decodes(lv) for lv in self._levels)

    @staticmethod
    def _decodes(lv: Level) -> bool:
        if lv.jpeg_colorspace is not None:
            return True
        # YCbCr only where the JPEG decoder turns it into RGB
        colour = (MINISBLACK, RGB) + ((YCBCR,) if lv.compression in (JPEG, OLD_JPEG) else ())
        return (
            lv.page_decode is not None
            and lv.compression in tifffile.TIFF.DECOMPRESSORS  # a codec imagecodecs has
            and lv.photometric in colour
            and lv.samples <= 4
        )

    def byte_ranges(self, window: Window, out_size: int) -> list[Range]:
        """(offset, size) of the storage segments a read of ``window`` (shrunk to
        ``out_size``) would fetch because the cache lacks them."""
        l0_x, l0_y, level, l_w, l_h = window
        lv = self._levels[level]
        l_x, l_y = self._level_xy(level, l0_x, l0_y)
        scale = self._dct_scale(l_x, l_y, level, l_w, l_h, out_size, out_size)
        return [
            (int(lv.offsets[i]), int(lv.counts[i]))
            for i in self._covering(level, l_x, l_y, l_w, l_h)
            if (self.path, level, i, scale) not in self._cache
        ]

    def ranges_of(self, windows: list[Window], out_size: int) -> list[Range]:
        """`byte_ranges` of every window, in order. Windows that are exactly one storage tile
        at full size (a tile grid laid on the storage tiles, the common case) are planned
        together with numpy; the others one by one (a batch's look-ahead: ~2.5 -> ~0.3 us a
        tile, on the reading path of every batch)."""
        spots = np.asarray(windows, dtype=np.int64).reshape(-1, 5)
        whole = np.zeros(len(spots), dtype=bool)
        segment, offsets, counts = (np.zeros(len(spots), dtype=np.int64) for _ in range(3))
        for level in np.unique(spots[:, 2]).tolist():
            if 0 <= level < len(self._levels):  # (else byte_ranges says what is wrong)
                here = spots[:, 2] == level
                lv, ds = self._levels[level], self.meta.level_downsamples[level]
                fits, at = lv.whole_tiles(spots[here], ds, out_size)
                whole[here], segment[here] = fits, at
                offsets[here], counts[here] = lv.offsets[at], lv.counts[at]
        if whole.all() and not self._cache:  # (no segment decoded yet: none to leave out)
            return list(zip(offsets.tolist(), counts.tolist(), strict=True))
        ranges: list[Range] = []
        for n, window in enumerate(windows):
            if not whole[n]:
                ranges.extend(self.byte_ranges(window, out_size))
            elif (self.path, int(spots[n, 2]), int(segment[n]), 1) not in self._cache:
                ranges.append((int(offsets[n]), int(counts[n])))
        return ranges

    def prefetch(self, windows: list[Window], out_size: int) -> None:
        """Start fetching the bytes of these windows' segments in the background: range
        requests (coalesced, concurrent) for a URL, kernel read-ahead for a local file."""
        if self.closed:
            return
        ranges = self.ranges_of(windows, out_size)
        if self._remote is not None:
            self._remote.prefetch(ranges)
        else:
            read_ahead(self._fd, ranges)

    def close(self) -> None:
        """Close the file. The parsed layout stays, so `reopen` is cheap."""
        self._closed = True
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def layout_bytes(self) -> int:
        """Memory of the parsed layout a closed reader keeps (see `HandlePool`)."""
        return self._layout_bytes

    def reopen(self) -> bool:
        """Open the file again, reusing the parsed layout: one ``open`` instead of tifffile's
        parse (~2 ms, more on big slides). False when the file is no longer the one parsed
        (replaced, rewritten: other inode, size or mtime) or cannot be opened."""
        if not self.closed:
            return True
        if self._remote is not None:  # nothing held open; the object was checked when parsed
            self._closed = False
            return True
        try:
            fd = open_regular(self.path)  # a FIFO put in its place must not block it
        except OSError:
            return False
        if identity(os.fstat(fd)) != self.identity:
            os.close(fd)
            return False
        self._fd = fd
        self._closed = False
        return True

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", True)

    def __del__(self) -> None:  # a reader dropped without close() must not leak its file
        self.close()
