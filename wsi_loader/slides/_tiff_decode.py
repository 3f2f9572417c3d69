"""Decoding one pyramid level's storage segments: the level's segment geometry (`Level`), its
JPEG segments decoded by libjpeg-turbo with the shared JPEG tables (optionally DCT-scaled), and
the samples of other codecs turned into RGB as OpenSlide gives them (`to_rgb`)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import imagecodecs
import numpy as np
import numpy.typing as npt
import simplejpeg
import tifffile

from wsi_loader.slides._base import RGBArray

JPEG = 7
UNCOMPRESSED = 1
MINISBLACK, RGB, YCBCR = 1, 2, 6
OLD_JPEG = 6  # Compression: old-style JPEG (TIFF 6.0 section 22, withdrawn)
# What a corrupt or truncated segment raises (imagecodecs' codec errors are RuntimeErrors,
# tifffile's and PIL's ValueErrors and OSErrors): a failed tile. Anything else (IndexError,
# TypeError...) is a bug and propagates, never filled and quarantined as bad data.
DATA_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError, RuntimeError, EOFError, zlib.error)
_UNASSALPHA = 2  # ExtraSamples: unassociated alpha (1 associated, 0 unspecified)
# APP14 "Adobe" marker, version 100, transform 0: the three components are RGB, not YCbCr
_SOI = b"\xff\xd8"  # JPEG start of image
_ADOBE_RGB = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00"
# Compressions imagecodecs decodes: none, LZW, JPEG, deflate, JPEG 2000 (Aperio), ZSTD, WebP
RAW_COMPRESSIONS = frozenset({1, 5, 7, 8, 32946, 33003, 33005, 34712, 50000, 50001})
DCT_SCALES = (2, 4, 8)


def to_rgb(
    pixels: npt.NDArray[np.generic], bits: int | None = None, associated: bool = False
) -> RGBArray:
    """Convert decoded samples (grey, grey+alpha, RGB, RGBA; any integer depth) to RGB uint8.

    ``bits`` is the stored depth (BitsPerSample): 12-bit samples arrive as uint16 and are
    scaled by 4095, not by 65535; 16-bit grey keeps its high byte and 16-bit colour is rounded
    (what libtiff, and so OpenSlide, gives). An alpha sample is composited onto white exactly as
    OpenSlide's pixels are (`composite_like_openslide`); ``associated``: the colour is already
    premultiplied by alpha (ExtraSamples 1, or 0 = unspecified, which libtiff treats alike)."""
    grey = pixels.ndim == 2 or pixels.shape[-1] in (1, 2)
    if pixels.dtype == np.uint16 and grey and bits in (None, 16):
        # libtiff (OpenSlide) keeps the high byte of 16-bit grey; of RGB it rounds, as below
        pixels = np.right_shift(pixels, 8).astype(np.uint8)
    if pixels.dtype != np.uint8:
        if np.issubdtype(pixels.dtype, np.integer):
            top = float(np.iinfo(pixels.dtype.type).max)  # type: ignore[type-var]
            if bits is not None and 8 < bits < 8 * pixels.dtype.itemsize:
                top = float(2**bits - 1)
            scale = 255.0 / top
        else:
            scale = 255.0 / max(float(pixels.max()), 1e-9)
        pixels = np.clip(pixels.astype(np.float32) * scale + 0.5, 0, 255).astype(np.uint8)
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    samples = pixels.shape[-1]
    if samples in (2, 4):  # composite the alpha sample onto white
        pixels = composite_like_openslide(pixels[..., :-1], pixels[..., -1:], associated)
        samples -= 1
    if samples == 1:
        return np.repeat(pixels, 3, axis=-1)
    return np.ascontiguousarray(pixels[..., :3])


def composite_like_openslide(
    colour: npt.NDArray[Any], alpha: npt.NDArray[Any], associated: bool
) -> npt.NDArray[np.uint8]:
    """Colour with alpha onto white, bit for bit what OpenSlide then `rgba_to_rgb` give:
    libtiff premultiplies unassociated alpha (``(c * a + 127) // 255``), OpenSlide hands out
    premultiplied ARGB, openslide-python un-premultiplies it with a truncating ``255 * c // a``,
    and the result is composited onto white like any OpenSlide read."""
    a = alpha.astype(np.int32)
    c = colour.astype(np.int32)
    premultiplied = c if associated else (c * a + 127) // 255
    straight = np.where(a == 255, premultiplied, 255 * premultiplied // np.maximum(a, 1))
    straight = np.where(a == 0, 0, np.minimum(straight, 255))
    return ((straight * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


class Level:
    """Segment geometry of one pyramid level (tiles, or strips that span the full width).

    Compact and file-free, so a closed reader keeps it for a cheap reopen: segment offsets and
    byte counts as int64 arrays (16 bytes a segment; tifffile's tuples of ints take ~80), and
    tifffile's page only where its decoder is needed (codecs other than the fast JPEG path).
    """

    def __init__(self, page: tifffile.TiffPage) -> None:
        self.height, self.width = int(page.imagelength), int(page.imagewidth)
        self.is_tiled = bool(page.is_tiled)
        self.compression = int(page.compression)
        self.samples = int(page.samplesperpixel)
        self.bits = int(page.bitspersample)
        self.photometric = int(page.photometric)
        extras = tuple(page.extrasamples or ())
        self.associated_alpha = bool(extras) and int(extras[0]) != _UNASSALPHA
        if page.is_tiled:
            self.seg_w, self.seg_h = int(page.tilewidth), int(page.tilelength)
        else:
            self.seg_w, self.seg_h = self.width, int(min(page.rowsperstrip, self.height))
        self.across = math.ceil(self.width / self.seg_w)
        self.down = math.ceil(self.height / self.seg_h)
        self.offsets = np.asarray(page.dataoffsets, dtype=np.int64)
        self.counts = np.asarray(page.databytecounts, dtype=np.int64)
        if page.planarconfig != 1 and page.samplesperpixel > 1:
            raise ValueError("planar-separate multi-sample pages are not supported")
        # Fast JPEG path: decode with libjpeg-turbo directly (optionally DCT-scaled), only for
        # 8-bit RGB/YCbCr tiles whose colour space we can state without tifffile's help.
        self.tables: bytes | None = page.jpegtables
        self.jpeg_colorspace: tuple[int | None, int] | None = None
        if (
            page.compression == JPEG
            and page.is_tiled
            and page.samplesperpixel == 3
            and page.bitspersample == 8
            and not page.extrasamples
        ):
            if page.photometric == YCBCR or (page.photometric == RGB and page.is_jfif):
                self.jpeg_colorspace = (None, RGB)
            elif page.photometric == RGB:
                self.jpeg_colorspace = (RGB, RGB)  # Aperio's RGB JPEGs carry no JFIF marker
        # libjpeg's DCT scaling guesses the colour space from markers: safe for YCbCr only
        self.dct_scalable = self.jpeg_colorspace == (None, RGB)
        # what goes before a segment's data (after its SOI) to make a complete stream, built once
        head = self.tables[:-2] if self.tables else _SOI
        if self.jpeg_colorspace == (RGB, RGB):
            head = head[:2] + _ADOBE_RGB + head[2:]
        self._jpeg_head = head
        # tifffile's decoder for the other codecs (keeps the page, and with it the file's tags).
        # tifffile builds it lazily and may read the file to do so (JPEG in strips checks for a
        # JFIF marker): build it now, while the file is open, and keep the reason it could not.
        self.page: tifffile.TiffPage | None = page if self.jpeg_colorspace is None else None
        self.page_decode: Callable[..., Any] | None = None
        self.page_decode_error: str | None = None
        if self.page is not None:
            try:
                self.page_decode = page.decode
            except Exception as exc:  # an unsupported codec: every read says why
                self.page_decode_error = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)

    @property
    def nbytes(self) -> int:
        """Approximate memory held, for the pool's budget of closed readers kept for reopening."""
        segments = len(self.offsets)
        return 16 * segments + (96 * segments if self.page is not None else 0) + 1024

    def whole_tiles(
        self, windows: npt.NDArray[np.int64], downsample: float, out_size: int
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
        """Which of these windows of this level ((N, 5) level-0 x, y, level, width, height)
        are exactly one storage tile read at full size, and its segment (0 for the others):
        `TiffReader._whole_tile` of many windows at once, with numpy."""
        x, y, w, h = (windows[:, k] for k in (0, 1, 3, 4))
        if downsample != 1:  # l0_to_level: round half to even, as Python's round
            x, y = (
                np.rint(x / downsample).astype(np.int64),
                np.rint(y / downsample).astype(np.int64),
            )
        fits: npt.NDArray[np.bool_] = (
            (w == self.seg_w)
            & (h == self.seg_h)
            & (w == out_size)  # full size: no DCT scaling
            & (x >= 0)
            & (y >= 0)
            & (x % self.seg_w == 0)
            & (y % self.seg_h == 0)
            & (x + w <= self.width)
            & (y + h <= self.height)
        )
        segment = np.where(fits, (y // self.seg_h) * self.across + x // self.seg_w, 0)
        return fits, segment.astype(np.int64)

    def _libjpeg_reason(self, data: bytes, exc: ValueError) -> str:
        """libjpeg's own words for a failed decode (TurboJPEG's header errors are vaguer, e.g.
        "Could not determine subsampling level" for OpenSlide's "Bogus marker length")."""
        assert self.jpeg_colorspace is not None
        colorspace, outcolorspace = self.jpeg_colorspace
        try:
            imagecodecs.jpeg8_decode(
                data, tables=self.tables, colorspace=colorspace, outcolorspace=outcolorspace
            )
        except Exception as libjpeg_error:  # any codec error: its message is the reason
            return str(libjpeg_error) or str(exc)
        return str(exc)  # a corrupt-data warning, which only strict mode reports

    def complete_jpeg(self, data: bytes) -> bytes:
        """A segment's abbreviated JPEG stream with the shared tables spliced in (and, for an
        RGB level, the Adobe marker saying so): one complete JPEG, for decoders that take no
        separate tables (nvJPEG, libjpeg-turbo's TurboJPEG). One copy of the segment."""
        if not data.startswith(_SOI):
            return data  # not a JPEG stream: the decoder says so
        return b"".join((self._jpeg_head, memoryview(data)[2:]))

    def decode_jpeg(self, data: bytes, out: RGBArray | None = None, scale: int = 1) -> RGBArray:
        """libjpeg-turbo decode of one of this level's JPEG segments (``jpeg_colorspace`` set),
        DCT-scaled down by ``scale``, into ``out`` when given. Reads only immutable fields:
        safe on any thread.

        libjpeg's corrupt-data warnings ("Corrupt JPEG data: ...", "Premature end of JPEG
        file") fail the decode with ValueError, as they fail OpenSlide's reads: simplejpeg's
        strict mode (imagecodecs decodes such data without a word). An RGB stream without
        markers (Aperio's) gets an Adobe APP14 marker saying so (transform 0), which makes
        libjpeg decode it as RGB, exactly as OpenSlide does.
        """
        assert self.jpeg_colorspace is not None
        stream = self.complete_jpeg(data)
        height, width = -(-self.seg_h // scale), -(-self.seg_w // scale)
        try:
            pixels: RGBArray = simplejpeg.decode_jpeg(
                stream,
                colorspace="RGB",
                min_height=height,
                min_width=width,
                buffer=out,
                strict=True,
            )
        except ValueError as exc:
            raise ValueError(self._libjpeg_reason(data, exc)) from exc
        if pixels.shape[:2] != (height, width):
            raise ValueError(
                f"a JPEG segment of {pixels.shape[1]}x{pixels.shape[0]} px where the level's "
                f"tiles are {self.seg_w}x{self.seg_h} (scaled 1/{scale})"
            )
        return pixels
