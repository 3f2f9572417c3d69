"""Picture helpers shared by predict's heatmaps and view's overviews and mosaics: a slide's
thumbnail from its coarsest fitting level, scale bars, hatching of areas with nothing to show,
the default font, and PNG rendering for objects that show themselves in Jupyter.

Torch-free; imports the slides and index layers only.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from wsi_loader.errors import TileReadError
from wsi_loader.files import replacing
from wsi_loader.index._tissue import read_mask_image
from wsi_loader.slides._base import MAX_PLAUSIBLE_MPP, MIN_PLAUSIBLE_MPP, RGBArray
from wsi_loader.slides._open import open_slide


def load_font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def _nice_length(max_um: float) -> float:
    """The largest 1/2/5 x 10^k micrometres not above ``max_um``."""
    exponent = math.floor(math.log10(max_um))
    for step in (5, 2, 1):
        if step * 10**exponent <= max_um:
            return float(step * 10**exponent)
    return float(10**exponent)


def measured_mpp(mpp: float | None, source: str | None) -> bool:
    """Whether an MPP was measured (vendor, manifest, TIFF tags) and plausible: the scale bar
    is drawn only then."""
    return bool(
        mpp
        and source in ("vendor", "manifest", "tiff-resolution")
        and MIN_PLAUSIBLE_MPP <= mpp <= MAX_PLAUSIBLE_MPP
    )


def scale_bar(
    draw: ImageDraw.ImageDraw, at: tuple[int, int], width: int, um_per_px: float, font: Any
) -> None:
    """A bar of a round length, about 30% of ``width`` pixels, with its length in um or mm."""
    length_um = _nice_length(width * 0.3 * um_per_px)
    length_px = length_um / um_per_px
    x, y = at
    draw.rectangle((x, y, x + length_px, y + 6), fill="black")
    label = f"{length_um / 1000:g} mm" if length_um >= 1000 else f"{length_um:g} um"
    draw.text((x + 6 + length_px, y - 5), label, fill="black", font=font)


def hatch(
    draw: ImageDraw.ImageDraw,
    box: tuple[float, float, float, float],
    colour: tuple[int, int, int],
    step: int = 6,
) -> None:
    """A filled, outlined box crossed by diagonal lines: an area with nothing to show."""
    left, top, right, bottom = (round(v) for v in box)
    draw.rectangle(box, fill=(*colour, 90), outline=(*colour, 255), width=2)
    for offset in range(step, (right - left) + (bottom - top), step):  # diagonals, clipped
        start = (min(left + offset, right), top + max(0, left + offset - right))
        end = (left + max(0, top + offset - bottom), min(top + offset, bottom))
        draw.line((*start, *end), fill=(*colour, 200), width=1)


def slide_thumbnail(
    path: str, max_size: int
) -> tuple[RGBArray, list[tuple[int, int, int, int]], tuple[int, int]]:
    """A slide's thumbnail (longest side at most ``max_size``), the thumbnail boxes that could
    not be read, and the slide's level-0 size. Read from the coarsest level still at least
    ``max_size`` wide (never level 0 of a pyramid unless the slide itself is that small), or
    from a coarser one if that level has bad tiles; when every level has some, from that level
    with what it can read."""
    reader = open_slide(path)
    try:
        dims = reader.meta.level_dimensions
        level = max((i for i, d in enumerate(dims) if max(d) >= max_size), default=0)
        unreadable: list[tuple[int, int, int, int]] = []
        for candidate in range(level, reader.meta.level_count):
            try:
                return read_mask_image(reader, max_size, candidate)[0], [], reader.meta.dimensions
            except TileReadError:
                continue
        thumb = read_mask_image(reader, max_size, level, unreadable)[0]
        return thumb, unreadable, reader.meta.dimensions
    finally:
        reader.close()


class Renders:
    """PNG rendering shared by the visual objects (the subclass sets ``image``)."""

    image: Image.Image

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.image.save(buf, "PNG")
        return buf.getvalue()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a PNG (whole or not at all: see `wsi_loader.files`)."""
        with replacing(Path(path)) as tmp:
            self.image.save(tmp, "PNG")
