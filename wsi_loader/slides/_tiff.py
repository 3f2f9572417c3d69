"""tifffile backend: reads TIFF-family slides segment by segment, without OpenSlide.

It opens TIFFs that OpenSlide rejects (plain strip TIFFs, QPTIFF) and reads tiled TIFFs by
fetching the compressed storage tiles a window covers and decoding only those (JPEG with
shared tables by libjpeg-turbo through simplejpeg, strict about corrupt data as OpenSlide is;
JPEG 2000, deflate, LZW, ZSTD... by imagecodecs through tifffile). Its errors do not latch: a
corrupt tile raises `TileReadError` and the next read works.
"""

from __future__ import annotations

import errno
import io
import logging
import math
import os
import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import Any

import imagecodecs
import numpy as np
import numpy.typing as npt
import simplejpeg
import tifffile
from defusedxml import DefusedXmlException
from defusedxml.ElementTree import fromstring as xml_from_text

from wsi_loader.errors import (
    SlideNotFoundError,
    SlideOpenError,
    TileReadError,
    WsiLoaderError,
    describe,
)
from wsi_loader.slides._base import (
    NOT_REGULAR,
    MppSource,
    RGBArray,
    SegmentJob,
    SegmentKey,
    SlideMeta,
    SlideReader,
    StoredSizes,
    Window,
    closed_error,
    join_notes,
    l0_to_level,
    non_square_note,
    open_regular,
    resize,
)
from wsi_loader.slides.storage._sources import Range, RangeStore, RemoteBytes, is_url, read_ahead

log = logging.getLogger(__name__)

_UNIT_TO_UM = {2: 25400.0, 3: 10000.0}  # ResolutionUnit inch / centimetre -> micrometres
# OME UnitsLength symbols -> micrometres (OME's default unit is the micrometre)
_OME_UNIT_TO_UM = {
    "m": 1e6,
    "dm": 1e5,
    "cm": 1e4,
    "mm": 1e3,
    "\u00b5m": 1.0,  # micro sign, the spelling OME's schema uses
    "\u03bcm": 1.0,  # Greek mu
    "um": 1.0,
    "nm": 1e-3,
    "pm": 1e-6,
    "\u00c5": 1e-4,  # angstrom
    "in": 25400.0,
}
_JPEG = 7
_UNCOMPRESSED = 1
_MINISBLACK, _RGB, _YCBCR = 1, 2, 6
_OLD_JPEG = 6  # Compression: old-style JPEG (TIFF 6.0 section 22, withdrawn)
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


class _ParseMessages(logging.Filter):
    """What tifffile logs while a thread of ours parses a file, kept instead of printed.

    Why: tifffile logs its complaints about a malformed file (``invalid page offset`` for a
    truncated one) at ERROR on every parse, and a slide that fails is parsed again at every
    retry and batch: 336 lines over 5 epochs for one truncated slide, next to our own one
    WARNING for it. What it says goes into our error when the parse fails, and to DEBUG when
    it does not. Other threads' tifffile messages pass (the list is per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        kept: list[str] | None = getattr(self._local, "kept", None)
        if kept is None:
            return True
        kept.append(record.getMessage())
        return False

    @contextmanager
    def kept(self) -> Iterator[list[str]]:
        """The messages tifffile logs in this thread inside the block."""
        outer = getattr(self._local, "kept", None)
        kept: list[str] = []
        self._local.kept = kept
        try:
            yield kept
        finally:
            self._local.kept = outer


_parse_messages = _ParseMessages()
logging.getLogger("tifffile").addFilter(_parse_messages)


def _open_local(path: str) -> int:
    """`open_regular`, its errors as a slide's (the file is gone, or is not a file)."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise SlideNotFoundError("slide file does not exist", path=path) from None
    except OSError as exc:
        reason = exc.strerror if exc.errno != errno.EINVAL else NOT_REGULAR
        raise SlideOpenError(f"cannot open the slide: {reason}", path=path) from exc


def _named_file(fd: int, path: str) -> io.BufferedReader:
    """A buffered file object over ``fd`` (left open when it is closed) named ``path``, as
    tifffile names the files it opens itself (their folder is where it finds an OME-TIFF's
    companion files)."""
    raw = io.FileIO(fd, "rb", closefd=False)
    raw.name = path
    return io.BufferedReader(raw)


def _said(messages: list[str], limit: int = 3) -> str:
    """tifffile's messages for an error text (the first few, each bounded)."""
    if not messages:
        return ""
    shown = "; ".join(m[:200] for m in messages[:limit])
    more = f" (and {len(messages) - limit} more)" if len(messages) > limit else ""
    return f" (tifffile said: {shown}{more})"


class SegmentCache:
    """Cache of decoded storage segments, bounded in bytes, shared by a process's readers.

    Neighbouring windows that share storage tiles (256 px windows on 512 px tiles, overlapping
    grids, the context windows of neighbouring tiles) decode each tile once.

    A segmented LRU: a segment enters on probation, and one used again moves to the
    protected part (at most half the bytes), whose least recent segments fall back to
    probation. Why: a sampler that draws tiles at random over a big slide decodes a stream of
    segments used once, which in a plain LRU pushes out the few that are used over and over
    (the coarse-level segments under many tiles' context windows: 224 px at 2.0 um/px of a
    40x slide spans ~19 of its 0.5 um/px tiles). Only `get` is a use; ``key in cache`` only
    looks. A segment put with ``planned`` (decoded ahead by a thread for a window read next)
    waits apart until that read, its first `get`, which counts as the use it was decoded for;
    it is evicted only after every other segment: dropping work done for the next read would
    decode it again (a whole-slide scan decoded 1.55x its storage tiles that way).
    Eviction order: probation, protected, then the planned ones, each least recent first.
    """

    def __init__(self, max_bytes: int = 32 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._planned: OrderedDict[SegmentKey, RGBArray] = OrderedDict()
        self._probation: OrderedDict[SegmentKey, RGBArray] = OrderedDict()
        self._protected: OrderedDict[SegmentKey, RGBArray] = OrderedDict()
        self._bytes = {"planned": 0, "probation": 0, "protected": 0}

    def _parts(self) -> list[tuple[str, OrderedDict[SegmentKey, RGBArray]]]:
        """The parts in eviction order."""
        return [
            ("probation", self._probation),
            ("protected", self._protected),
            ("planned", self._planned),
        ]

    def __contains__(self, key: SegmentKey) -> bool:
        return key in self._protected or key in self._probation or key in self._planned

    def get(self, key: SegmentKey) -> RGBArray | None:
        """The segment (a use of it), None when absent."""
        pixels = self._protected.get(key)
        if pixels is not None:
            self._protected.move_to_end(key)
            return pixels
        pixels = self._planned.pop(key, None)
        if pixels is not None:  # the use it was decoded for: on probation from now
            self._bytes["planned"] -= pixels.nbytes
            self._probation[key] = pixels
            self._bytes["probation"] += pixels.nbytes
            return pixels
        pixels = self._probation.pop(key, None)
        if pixels is None:
            return None
        self._bytes["probation"] -= pixels.nbytes  # used again: protected
        self._protected[key] = pixels
        self._bytes["protected"] += pixels.nbytes
        while self._bytes["protected"] > self.max_bytes // 2:
            old, demoted = self._protected.popitem(last=False)
            self._bytes["protected"] -= demoted.nbytes
            self._probation[old] = demoted
            self._bytes["probation"] += demoted.nbytes
        return pixels

    def put(self, key: SegmentKey, pixels: RGBArray, planned: bool = False) -> None:
        """Keep a segment just decoded and used (``planned``: decoded for a use to come)."""
        if pixels.nbytes > self.max_bytes:
            return
        self.pop(key)
        part = "planned" if planned else "probation"
        (self._planned if planned else self._probation)[key] = pixels
        self._bytes[part] += pixels.nbytes
        while sum(self._bytes.values()) > self.max_bytes:
            name, segments = next((n, p) for n, p in self._parts() if p)
            _, evicted = segments.popitem(last=False)
            self._bytes[name] -= evicted.nbytes

    def pop(self, key: SegmentKey) -> RGBArray | None:
        for name, segments in self._parts():
            pixels = segments.pop(key, None)
            if pixels is not None:
                self._bytes[name] -= pixels.nbytes
                return pixels
        return None

    def clear(self) -> None:
        for name, segments in self._parts():
            segments.clear()
            self._bytes[name] = 0


def _resolution_mpp(page: tifffile.TiffPage, axis: str = "X") -> float | None:
    """MPP from the X/YResolution and ResolutionUnit tags, None when absent or unit-less."""
    res = page.tags.get(f"{axis}Resolution")
    unit = page.tags.get("ResolutionUnit")
    if res is None or unit is None or int(unit.value) not in _UNIT_TO_UM:
        return None
    num, den = res.value
    if num <= 0 or den <= 0:
        return None
    return float(_UNIT_TO_UM[int(unit.value)] * den / num)


def _ome_mpps(xml: str | None) -> tuple[float | None, float | None]:
    """MPP across and down from an OME-XML description: the first image's ``PhysicalSizeX``
    and ``PhysicalSizeY`` in their units. None when absent, not a length (``pixel``), or
    unreadable: a bad description is not a bad slide."""
    if not xml:
        return None, None
    try:
        root = xml_from_text(xml)
    except (SyntaxError, ValueError, DefusedXmlException) as exc:  # ParseError is a SyntaxError
        log.debug("OME-XML not readable (%s): no pixel size from it", exc)
        return None, None
    pixels = next((e for e in root.iter() if e.tag.rpartition("}")[2] == "Pixels"), None)
    if pixels is None:
        return None, None

    def size(axis: str) -> float | None:
        value = pixels.get(f"PhysicalSize{axis}")
        scale = _OME_UNIT_TO_UM.get(pixels.get(f"PhysicalSize{axis}Unit", "\u00b5m").strip())
        try:
            mpp = float(value) * scale if value is not None and scale is not None else None
        except ValueError:
            return None
        return mpp if mpp is not None and math.isfinite(mpp) and mpp > 0 else None

    return size("X"), size("Y")


def _aperio_field(description: str, name: str) -> float | None:
    """A number from an Aperio ImageDescription (``...|MPP = 0.4990|AppMag = 20|...``)."""
    match = re.search(rf"\|\s*{name}\s*=\s*([0-9.]+)", description)
    try:
        return float(match.group(1)) if match else None
    except ValueError:
        return None


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    """What says a file is still the one parsed: device, inode, size, modification time."""
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


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


def _channels_note(series: tifffile.TiffPageSeries, page: tifffile.TiffPage) -> str | None:
    """Say so when the series holds more than the page read: one grey page per channel
    (multiplex fluorescence: only the first channel is read, as grey), or several pages of
    another kind (a stack of RGB images: the first is read, in colour)."""
    per_page = math.prod(page.shape)
    count = math.prod(series.shape) // per_page if per_page else 1
    if count <= 1:
        return None
    if int(page.samplesperpixel) >= 3:
        return f"{count} images ({series.axes}); only the first is read, in colour"
    return f"{count} channels ({series.axes}); only channel 0 is read, as grey"


class _Level:
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
            page.compression == _JPEG
            and page.is_tiled
            and page.samplesperpixel == 3
            and page.bitspersample == 8
            and not page.extrasamples
        ):
            if page.photometric == _YCBCR or (page.photometric == _RGB and page.is_jfif):
                self.jpeg_colorspace = (None, _RGB)
            elif page.photometric == _RGB:
                self.jpeg_colorspace = (_RGB, _RGB)  # Aperio's RGB JPEGs carry no JFIF marker
        # libjpeg's DCT scaling guesses the colour space from markers: safe for YCbCr only
        self.dct_scalable = self.jpeg_colorspace == (None, _RGB)
        # what goes before a segment's data (after its SOI) to make a complete stream, built once
        head = self.tables[:-2] if self.tables else _SOI
        if self.jpeg_colorspace == (_RGB, _RGB):
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
        with _parse_messages.kept() as said:
            try:
                if is_url(path):
                    self._remote = RemoteBytes(path, store if store is not None else RangeStore())
                    handle = self._remote.open_for_parsing()
                else:  # our own descriptor (pread: no file position), lent to tifffile
                    self._fd = _open_local(path)
                    handle = _named_file(self._fd, path)
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
        self._identity = _identity(os.fstat(self._fd)) if self._remote is None else None
        self._closed = False
        self._cache = cache if cache is not None else SegmentCache()
        self._layout_bytes = sum(lv.nbytes for lv in self._levels)

    def _refuse_undecodable_old_jpeg(self) -> None:
        """Old-style JPEG (Compression 6) comes in variants; tifffile decodes those whose
        segments are whole JPEG streams. Any other indexed as ok and then failed every tile
        ("Not a JPEG file"): one segment is decoded now, and the file refused if it fails."""
        for number, lv in enumerate(self._levels):
            if lv.compression != _OLD_JPEG or not len(lv.offsets):
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
            self._levels = [_Level(page) for page in pages]
            ome = tif.ome_metadata if series.kind == "ome" else None
            self.meta = self._read_meta(series, pages[0], ome)

    def _read_meta(
        self, series: tifffile.TiffPageSeries, base_page: tifffile.TiffPage, ome: str | None
    ) -> SlideMeta:
        base = self._levels[0]
        mpp, mpp_y = _resolution_mpp(base_page), _resolution_mpp(base_page, "Y")
        source: MppSource = "tiff-resolution" if mpp is not None else "missing"
        ome_mpp, ome_mpp_y = _ome_mpps(ome)
        if ome_mpp is not None:  # the writer's own statement; resolution tags are often 72 dpi
            mpp, mpp_y, source = ome_mpp, ome_mpp_y, "vendor"
        objective = None
        vendor = {"generic": "generic-tiff"}.get(series.kind, f"tiff-{series.kind}")
        if series.kind == "svs":
            vendor = "aperio"
            description = base_page.description or ""
            mpp = mpp_y = _aperio_field(description, "MPP")  # Aperio states one MPP
            source = "vendor" if mpp is not None else "missing"
            objective = _aperio_field(description, "AppMag")
        dims = tuple((lv.width, lv.height) for lv in self._levels)
        downsamples = tuple(
            (base.width / lv.width + base.height / lv.height) / 2.0 for lv in self._levels
        )
        tiles = tuple((lv.seg_w, lv.seg_h) if lv.is_tiled else (0, 0) for lv in self._levels)
        return SlideMeta(
            backend=self.backend,
            vendor=vendor,
            level_dimensions=dims,
            level_downsamples=downsamples,
            mpp=mpp,
            mpp_source=source,
            objective_power=objective,
            tile_sizes=tiles,
            note=join_notes(_channels_note(series, base_page), non_square_note(mpp, mpp_y)),
        )

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
    def _full(lv: _Level, seg: RGBArray, scale: int) -> bool:
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
            or lv.compression == _UNCOMPRESSED
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
    def _decodes(lv: _Level) -> bool:
        if lv.jpeg_colorspace is not None:
            return True
        # YCbCr only where the JPEG decoder turns it into RGB
        colour = (_MINISBLACK, _RGB) + ((_YCBCR,) if lv.compression in (_JPEG, _OLD_JPEG) else ())
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

    def prefetch(self, windows: list[Window], out_size: int) -> None:
        """Start fetching the bytes of these windows' segments in the background: range
        requests (coalesced, concurrent) for a URL, kernel read-ahead for a local file."""
        if self.closed:
            return
        ranges = [r for window in windows for r in self.byte_ranges(window, out_size)]
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
        if _identity(os.fstat(fd)) != self._identity:
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
