"""Open a slide with the right backend.

``auto`` tries OpenSlide first (every vendor format it knows) and falls back to tifffile only
when OpenSlide does not recognise the file at all: a file OpenSlide detects but cannot open
(e.g. an unsupported compression) is reported with OpenSlide's reason.
"""

from __future__ import annotations

import os
from typing import Literal

import openslide

from wsi_loader.errors import SlideNotFoundError, SlideOpenError
from wsi_loader.slides.base import SlideReader
from wsi_loader.slides.openslide_backend import OpenSlideReader
from wsi_loader.slides.tiff_backend import TiffReader

Backend = Literal["auto", "openslide", "tiff"]
BACKENDS: tuple[str, ...] = ("auto", "openslide", "tiff")


def open_slide(
    path: str, backend: str = "auto", cache: openslide.OpenSlideCache | None = None
) -> SlideReader:
    """Open ``path`` and return a reader; raises `SlideNotFoundError` or `SlideOpenError`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not os.path.exists(path):
        raise SlideNotFoundError("slide file does not exist", path=path)
    if backend == "openslide":
        return OpenSlideReader(path, cache)
    if backend == "tiff":
        return TiffReader(path)
    try:
        return OpenSlideReader(path, cache)
    except SlideOpenError as openslide_error:
        if openslide.OpenSlide.detect_format(path) is not None:
            raise  # OpenSlide knows the format: its reason is the real one
        try:
            return TiffReader(path)
        except SlideOpenError as tiff_error:
            raise SlideOpenError(
                f"{_reason(openslide_error)}; {_reason(tiff_error)}", path=path
            ) from tiff_error


def _reason(error: SlideOpenError) -> str:
    """The message without the path prefix the error adds."""
    text = str(error)
    prefix = f"{error.path}: "
    return text[len(prefix) :] if error.path and text.startswith(prefix) else text
