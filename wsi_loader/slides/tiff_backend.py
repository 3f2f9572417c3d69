"""tifffile backend: reads TIFF-family slides segment by segment, without OpenSlide.

It opens TIFFs that OpenSlide rejects (plain strip TIFFs, QPTIFF) and reads tiled TIFFs by
fetching the compressed storage tiles a window covers and decoding only those (imagecodecs:
JPEG with shared tables, JPEG 2000, deflate, LZW, ZSTD...). Its errors do not latch: a corrupt
tile raises `TileReadError` and the next read works.
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict

import numpy as np
import numpy.typing as npt
import tifffile

from wsi_loader.errors import SlideOpenError, TileReadError
from wsi_loader.slides.base import MppSource, RGBArray, SlideMeta

log = logging.getLogger(__name__)

_UNIT_TO_UM = {2: 25400.0, 3: 10000.0}  # ResolutionUnit inch / centimetre -> micrometres


def _resolution_mpp(page: tifffile.TiffPage) -> float | None:
    """MPP from the XResolution/ResolutionUnit tags, None when absent or unit-less."""
    x_res = page.tags.get("XResolution")
    unit = page.tags.get("ResolutionUnit")
    if x_res is None or unit is None or int(unit.value) not in _UNIT_TO_UM:
        return None
    num, den = x_res.value
    if num <= 0 or den <= 0:
        return None
    return float(_UNIT_TO_UM[int(unit.value)] * den / num)


def _aperio_field(description: str, name: str) -> float | None:
    """A number from an Aperio ImageDescription (``...|MPP = 0.4990|AppMag = 20|...``)."""
    match = re.search(rf"\|\s*{name}\s*=\s*([0-9.]+)", description)
    try:
        return float(match.group(1)) if match else None
    except ValueError:
        return None


def to_rgb(pixels: npt.NDArray[np.generic]) -> RGBArray:
    """Convert decoded samples (grey, grey+alpha, RGB, RGBA; any integer depth) to RGB uint8."""
    if pixels.dtype != np.uint8:
        if np.issubdtype(pixels.dtype, np.integer):
            scale = 255.0 / float(np.iinfo(pixels.dtype.type).max)  # type: ignore[type-var]
        else:
            scale = 255.0 / max(float(pixels.max()), 1e-9)
        pixels = np.clip(pixels.astype(np.float32) * scale + 0.5, 0, 255).astype(np.uint8)
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    samples = pixels.shape[-1]
    if samples in (2, 4):  # composite the alpha sample onto white
        alpha = pixels[..., -1:].astype(np.uint16)
        colour = pixels[..., :-1].astype(np.uint16)
        pixels = ((colour * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
        samples -= 1
    if samples == 1:
        return np.repeat(pixels, 3, axis=-1)
    return np.ascontiguousarray(pixels[..., :3])


class _Level:
    """Segment geometry of one pyramid level (tiles, or strips that span the full width)."""

    def __init__(self, page: tifffile.TiffPage) -> None:
        self.page = page
        self.height, self.width = int(page.imagelength), int(page.imagewidth)
        if page.is_tiled:
            self.seg_w, self.seg_h = int(page.tilewidth), int(page.tilelength)
        else:
            self.seg_w, self.seg_h = self.width, int(min(page.rowsperstrip, self.height))
        self.across = math.ceil(self.width / self.seg_w)
        self.down = math.ceil(self.height / self.seg_h)
        self.offsets = page.dataoffsets
        self.counts = page.databytecounts
        if page.planarconfig != 1 and page.samplesperpixel > 1:
            raise ValueError("planar-separate multi-sample pages are not supported")


class TiffReader:
    """A `SlideReader` over tifffile, decoding only the storage segments a window covers."""

    backend = "tiff"

    def __init__(self, path: str, cache_bytes: int = 32 * 2**20) -> None:
        self.path = path
        self.broken = False  # tifffile errors do not latch; kept for the pool's protocol
        try:
            self._tif = tifffile.TiffFile(path)
            series = self._tif.series[0]
            candidates: list[object] = (
                list(self._tif.pages)  # SVS, as OpenSlide reads it: every tiled page is a level
                if series.kind == "svs"
                else [level.pages[0] for level in series.levels]
            )
            pages = [p for p in candidates if isinstance(p, tifffile.TiffPage)]
            if series.kind == "svs":
                pages = [p for p in pages if p.is_tiled]
            self._levels = [_Level(page) for page in pages]
        except Exception as exc:  # tifffile raises many types for malformed input
            self.close()
            raise SlideOpenError(f"tifffile: {type(exc).__name__}: {exc}", path=path) from exc
        self._cache: OrderedDict[tuple[int, int], RGBArray] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = cache_bytes
        self.meta = self._read_meta(series)

    def _read_meta(self, series: tifffile.TiffPageSeries) -> SlideMeta:
        base = self._levels[0]
        mpp = _resolution_mpp(base.page)
        source: MppSource = "tiff-resolution" if mpp is not None else "missing"
        objective = None
        vendor = f"tiff-{series.kind}" if series.kind else "tiff"
        if series.kind == "svs":
            vendor = "aperio"
            description = base.page.description or ""
            mpp = _aperio_field(description, "MPP")
            source = "vendor" if mpp is not None else "missing"
            objective = _aperio_field(description, "AppMag")
        dims = tuple((lv.width, lv.height) for lv in self._levels)
        downsamples = tuple(
            (base.width / lv.width + base.height / lv.height) / 2.0 for lv in self._levels
        )
        tiles = tuple((lv.seg_w, lv.seg_h) if lv.page.is_tiled else (0, 0) for lv in self._levels)
        return SlideMeta(
            backend=self.backend,
            vendor=vendor,
            level_dimensions=dims,
            level_downsamples=downsamples,
            mpp=mpp,
            mpp_source=source,
            objective_power=objective,
            tile_sizes=tiles,
        )

    def _segment(self, level: int, index: int) -> RGBArray:
        key = (level, index)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        lv = self._levels[level]
        fh = self._tif.filehandle
        fh.seek(lv.offsets[index])
        data = fh.read(lv.counts[index])
        decoded, _, _ = lv.page.decode(data, index, jpegtables=lv.page.jpegtables)
        if decoded is None:
            raise ValueError(f"segment {index} of level {level} is empty")
        pixels = to_rgb(decoded[0])  # decoded is (depth, length, width, samples)
        self._cache[key] = pixels
        self._cache_bytes += pixels.nbytes
        while self._cache_bytes > self._cache_limit and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.nbytes
        return pixels

    def read_region(self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int) -> RGBArray:
        try:
            return self._read_window(l0_x, l0_y, level, l_w, l_h)
        except Exception as exc:  # decoders raise codec-specific types
            raise TileReadError(
                f"read failed at level-0 ({l0_x}, {l0_y}), level {level}, {l_w}x{l_h}: {exc}",
                path=self.path,
                l0_x=l0_x,
                l0_y=l0_y,
                level=level,
                cause=f"{type(exc).__name__}: {exc}",
            ) from exc

    def _read_window(self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int) -> RGBArray:
        lv = self._levels[level]
        ds = self.meta.level_downsamples[level]
        l_x, l_y = int(l0_x / ds), int(l0_y / ds)
        out = np.full((l_h, l_w, 3), 255, dtype=np.uint8)  # outside the image: background
        x0, y0 = max(l_x, 0), max(l_y, 0)
        x1, y1 = min(l_x + l_w, lv.width), min(l_y + l_h, lv.height)
        if x0 >= x1 or y0 >= y1:
            return out
        for row in range(y0 // lv.seg_h, (y1 - 1) // lv.seg_h + 1):
            for col in range(x0 // lv.seg_w, (x1 - 1) // lv.seg_w + 1):
                seg = self._segment(level, row * lv.across + col)
                sx, sy = col * lv.seg_w, row * lv.seg_h
                ax, ay = max(x0, sx), max(y0, sy)
                bx = min(x1, sx + lv.seg_w, sx + seg.shape[1])
                by = min(y1, sy + lv.seg_h, sy + seg.shape[0])
                if ax < bx and ay < by:
                    out[ay - l_y : by - l_y, ax - l_x : bx - l_x] = seg[
                        ay - sy : by - sy, ax - sx : bx - sx
                    ]
        return out

    def close(self) -> None:
        tif = getattr(self, "_tif", None)
        if tif is not None:
            tif.close()
            self._tif = None  # type: ignore[assignment]
