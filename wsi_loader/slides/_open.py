"""Open a slide with the right backend.

``auto`` picks the fastest reader that reads the file correctly:

* Aperio SVS and generic tiled TIFFs whose levels are tiled with a codec imagecodecs decodes go
  to the raw tifffile path (compressed tiles decoded by libjpeg-turbo & co, ~4x OpenSlide), and
  so do 16-bit ones (OpenSlide reads their partial edge tiles wrong) and those OpenSlide cannot
  open at all, in a codec libtiff lacks (PNG, LZMA, LERC, JPEG XR, JPEG XL...);
* every other format OpenSlide detects (NDPI, MRXS, DICOM, ...) goes to OpenSlide;
* files OpenSlide does not recognise at all fall back to tifffile (plain strip TIFFs, QPTIFF).

A file OpenSlide detects but cannot open (e.g. an unsupported compression) is reported with
OpenSlide's reason. ``openslide`` and ``tiff`` force one backend.

A URL (``s3://``, ``gs://``, ``https://``) is read in place by the raw path when it is an Aperio
or generic tiled TIFF the raw path decodes (header by a few block reads, tiles by range
requests); any other slide is copied whole into the local cache (`LocalCopies`) and opened
from there.
"""

from __future__ import annotations

import os
import stat
from typing import Literal

import openslide

from wsi_loader.errors import SlideNotFoundError, SlideOpenError
from wsi_loader.slides._base import NOT_REGULAR, SlideReader
from wsi_loader.slides._openslide import OpenSlideReader
from wsi_loader.slides._segment_cache import SegmentCache
from wsi_loader.slides._tiff import TiffReader
from wsi_loader.slides.storage._local_copies import LocalCopies
from wsi_loader.slides.storage._sources import RangeStore, is_url, local_path

Backend = Literal["auto", "openslide", "tiff"]
BACKENDS: tuple[str, ...] = ("auto", "openslide", "tiff")
# OpenSlide formats whose files the raw tifffile path reads identically (tested pixel for pixel)
RAW_FORMATS = frozenset({"aperio", "generic-tiff"})
# remote objects worth trying in place (a TIFF structure the raw path may read)
RAW_SUFFIXES = (".svs", ".tif", ".tiff")


def open_slide(
    path: str,
    backend: str = "auto",
    cache: openslide.OpenSlideCache | None = None,
    segment_cache: SegmentCache | None = None,
    store: RangeStore | None = None,
    copies: LocalCopies | None = None,
) -> SlideReader:
    """Open ``path`` (a file or a URL) and return a reader; raises `SlideNotFoundError` or
    `SlideOpenError` (`TransientReadError` when a store cannot be reached).

    ``cache`` is the OpenSlide tile cache, ``segment_cache`` the raw path's decoded-tile cache,
    ``store`` the process's prefetched byte ranges of remote slides, ``copies`` the local cache
    of remote slides only OpenSlide reads.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    path = local_path(path)
    if is_url(path):
        return _open_remote(path, backend, cache, segment_cache, store, copies)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise SlideNotFoundError("slide file does not exist", path=path) from None
    except OSError as exc:
        raise SlideOpenError(f"cannot stat the slide: {exc.strerror}", path=path) from exc
    if not stat.S_ISREG(mode):  # opening a FIFO would block forever
        raise SlideOpenError(NOT_REGULAR, path=path)
    if backend == "openslide":
        return OpenSlideReader(path, cache)
    if backend == "tiff":
        return TiffReader(path, segment_cache)
    detected = openslide.OpenSlide.detect_format(path)
    raw = None
    if detected in RAW_FORMATS:
        try:
            raw = TiffReader(path, segment_cache)
        except SlideOpenError:
            raw = None
        if raw is not None and raw.qualifies():
            return raw
    try:
        reader: SlideReader = OpenSlideReader(path, cache)
    except SlideOpenError as openslide_error:
        if raw is not None and raw.decodes_every_level():
            return raw  # a codec OpenSlide lacks (PNG, LZMA, LERC, JPEG XR...): read raw
        if raw is not None:
            raw.close()
        if detected is not None:
            raise  # OpenSlide knows the format: its reason is the real one
        try:
            return TiffReader(path, segment_cache)
        except SlideOpenError as tiff_error:
            raise SlideOpenError(
                f"{_reason(openslide_error)}; {_reason(tiff_error)}", path=path
            ) from tiff_error
    if raw is not None:
        raw.close()
    return reader


def _open_remote(
    url: str,
    backend: str,
    cache: openslide.OpenSlideCache | None,
    segment_cache: SegmentCache | None,
    store: RangeStore | None,
    copies: LocalCopies | None,
) -> SlideReader:
    if backend == "tiff" or (backend == "auto" and url.lower().endswith(RAW_SUFFIXES)):
        raw = TiffReader(url, segment_cache, store)
        if backend == "tiff" or (raw.qualifies() and raw.meta.vendor in RAW_FORMATS):
            return raw
        raw.close()
    local = (copies if copies is not None else LocalCopies()).local(url)
    try:
        return open_slide(local, backend, cache, segment_cache)
    except SlideOpenError as exc:  # named by the object the user gave, not by its copy
        raise SlideOpenError(
            f"{_reason(exc)} (read from its local copy {local})", path=url
        ) from exc


def _reason(error: SlideOpenError) -> str:
    """The message without the path prefix the error adds."""
    text = str(error)
    prefix = f"{error.path}: "
    return text[len(prefix) :] if error.path and text.startswith(prefix) else text
