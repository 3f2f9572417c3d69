"""Open a slide with the right backend.

``auto`` picks the fastest reader that reads the file correctly:

* Aperio SVS and generic tiled TIFFs whose levels are tiled with a codec imagecodecs decodes go
  to the raw tifffile path (compressed tiles decoded by libjpeg-turbo & co, ~4x OpenSlide);
* every other format OpenSlide detects (NDPI, MRXS, DICOM, ...) goes to OpenSlide;
* files OpenSlide does not recognise at all fall back to tifffile (plain strip TIFFs, QPTIFF).

A file OpenSlide detects but cannot open (e.g. an unsupported compression) is reported with
OpenSlide's reason. ``openslide`` and ``tiff`` force one backend.
"""

from __future__ import annotations

import os
import stat
from typing import Literal

import openslide

from wsi_loader.errors import SlideNotFoundError, SlideOpenError
from wsi_loader.slides.base import SlideReader
from wsi_loader.slides.openslide_backend import OpenSlideReader
from wsi_loader.slides.tiff_backend import SegmentCache, TiffReader

Backend = Literal["auto", "openslide", "tiff"]
BACKENDS: tuple[str, ...] = ("auto", "openslide", "tiff")
# OpenSlide formats whose files the raw tifffile path reads identically (tested pixel for pixel)
RAW_FORMATS = frozenset({"aperio", "generic-tiff"})


def open_slide(
    path: str,
    backend: str = "auto",
    cache: openslide.OpenSlideCache | None = None,
    segment_cache: SegmentCache | None = None,
) -> SlideReader:
    """Open ``path`` and return a reader; raises `SlideNotFoundError` or `SlideOpenError`.

    ``cache`` is the OpenSlide tile cache, ``segment_cache`` the raw path's decoded-tile cache.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise SlideNotFoundError("slide file does not exist", path=path) from None
    except OSError as exc:
        raise SlideOpenError(f"cannot stat the slide: {exc.strerror}", path=path) from exc
    if not stat.S_ISREG(mode):  # opening a FIFO would block forever
        raise SlideOpenError("not a regular file (a FIFO, device or folder)", path=path)
    if backend == "openslide":
        return OpenSlideReader(path, cache)
    if backend == "tiff":
        return TiffReader(path, segment_cache)
    detected = openslide.OpenSlide.detect_format(path)
    if detected in RAW_FORMATS:
        try:
            raw = TiffReader(path, segment_cache)
        except SlideOpenError:
            raw = None
        if raw is not None and raw.qualifies():
            return raw
        if raw is not None:
            raw.close()
    try:
        return OpenSlideReader(path, cache)
    except SlideOpenError as openslide_error:
        if detected is not None:
            raise  # OpenSlide knows the format: its reason is the real one
        try:
            return TiffReader(path, segment_cache)
        except SlideOpenError as tiff_error:
            raise SlideOpenError(
                f"{_reason(openslide_error)}; {_reason(tiff_error)}", path=path
            ) from tiff_error


def _reason(error: SlideOpenError) -> str:
    """The message without the path prefix the error adds."""
    text = str(error)
    prefix = f"{error.path}: "
    return text[len(prefix) :] if error.path and text.startswith(prefix) else text
