"""OpenSlide backend: the universal reader (Aperio, Hamamatsu, MIRAX, DICOM, generic TIFF...).

OpenSlide errors latch: after one failed call every call on that handle fails until it is
closed. ``read_region`` therefore marks the reader ``broken`` so the handle pool reopens it.
OpenSlide itself is thread-safe, so ``read_job`` lets other threads read through one handle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np
import openslide

from wsi_loader.errors import SlideOpenError, TileReadError
from wsi_loader.slides._base import (
    MppSource,
    RGBArray,
    SlideMeta,
    SlideReader,
    closed_error,
    non_square_note,
    require_regular,
    resize,
    rgba_to_rgb,
)

log = logging.getLogger(__name__)

# Vendors whose MPP OpenSlide derives from the TIFF resolution tags rather than scanner metadata.
_RESOLUTION_TAG_VENDORS = {"generic-tiff"}


def _float_property(props: Mapping[str, str], key: str) -> float | None:
    value = props.get(key)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if number > 0 else None


class OpenSlideReader(SlideReader):
    """A `SlideReader` over one ``openslide.OpenSlide`` handle."""

    backend = "openslide"

    def __init__(self, path: str, cache: openslide.OpenSlideCache | None = None) -> None:
        self.path = path
        self.broken = False
        try:
            require_regular(path)  # OpenSlide opens it by name: a FIFO would block it
        except OSError as exc:
            raise SlideOpenError(str(exc.strerror), path=path) from exc
        try:
            self._slide = openslide.OpenSlide(path)
        except openslide.OpenSlideError as exc:  # includes OpenSlideUnsupportedFormatError
            raise SlideOpenError(f"OpenSlide: {exc}", path=path) from exc
        if cache is not None:
            self._slide.set_cache(cache)
        try:
            self.meta = self._read_meta()
        except openslide.OpenSlideError as exc:
            self.close()
            raise SlideOpenError(f"OpenSlide: {exc}", path=path) from exc

    def _read_meta(self) -> SlideMeta:
        slide = self._slide
        props = slide.properties
        vendor = props.get(openslide.PROPERTY_NAME_VENDOR) or "unknown"
        mpp = _float_property(props, openslide.PROPERTY_NAME_MPP_X)
        source: MppSource = "missing"
        if mpp is not None:
            source = "tiff-resolution" if vendor in _RESOLUTION_TAG_VENDORS else "vendor"
        tile_sizes = []
        for level in range(slide.level_count):
            tw = props.get(f"openslide.level[{level}].tile-width")
            th = props.get(f"openslide.level[{level}].tile-height")
            tile_sizes.append((int(tw), int(th)) if tw and th else (0, 0))
        return SlideMeta(
            backend=self.backend,
            vendor=vendor,
            level_dimensions=tuple((int(w), int(h)) for w, h in slide.level_dimensions),
            level_downsamples=tuple(float(d) for d in slide.level_downsamples),
            mpp=mpp,
            mpp_source=source,
            objective_power=_float_property(props, openslide.PROPERTY_NAME_OBJECTIVE_POWER),
            tile_sizes=tuple(tile_sizes),
            note=non_square_note(mpp, _float_property(props, openslide.PROPERTY_NAME_MPP_Y)),
        )

    def read_region(self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int) -> RGBArray:
        if self.closed:
            raise closed_error(self.path)
        try:
            image = self._slide.read_region((l0_x, l0_y), level, (l_w, l_h))
        except (openslide.OpenSlideError, OSError, ValueError) as exc:
            self.broken = True  # the handle's error state is sticky: it must be reopened
            raise TileReadError.for_region(self.path, l0_x, l0_y, level, l_w, l_h, exc) from exc
        return rgba_to_rgb(np.asarray(image))

    def read_job(
        self, dest: RGBArray, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int
    ) -> Callable[[], None] | None:
        """The call that reads a window into ``dest`` (resized to it) on another thread:
        OpenSlide handles are thread-safe and release the GIL while they read. A failure marks
        the reader broken like any other read; None when it already is."""
        if self.broken or self.closed:
            return None

        def read() -> None:
            pixels = self.read_region(l0_x, l0_y, level, l_w, l_h)
            dest[...] = resize(pixels, dest.shape[1], dest.shape[0])

        return read

    @property
    def closed(self) -> bool:
        return getattr(self, "_slide", None) is None

    def close(self) -> None:
        slide = getattr(self, "_slide", None)
        if slide is not None:
            slide.close()
            self._slide = None  # type: ignore[assignment]
