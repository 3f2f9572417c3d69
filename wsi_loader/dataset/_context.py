"""Co-centred context tiles: which level serves each scale, where its window lies, and which of
its pixels are on the slide. Torch-free (the exporter's workers read context too).

Context tiles are reads, not a new dataset: each index row keeps its one main window, and every
context scale ``(mpp, size)`` adds a window of ``size`` pixels at ``mpp`` centred on the main
window's centre, read in the same batch read (`TileReader.read`).

The rules, stated once:

- **Level.** As for the index's own tiles (`plan_read`): the coarsest level that is still at
  least as fine as the scale's MPP, within the index's ``mpp_tolerance``; a level within the
  tolerance is read as it is, any other window is shrunk to ``size`` (libjpeg's DCT scaling
  where the factor is 2, 4 or 8 and the window sits on its grid, bilinear otherwise). Level 0
  is read only when no coarser level has the resolution.
- **Centre.** Each scale's pixels form a grid over its level, counted from the slide's origin
  (pixel ``o`` covers level pixels ``[o * q, (o + 1) * q)``, ``q = read_size / size``). The
  context tile is the ``size`` x ``size`` block of that grid whose centre is nearest the main
  window's centre (halves round up, i.e. right and down). Its centre is the main centre
  exactly whenever the grid allows it (for a tile of the same level and pitch: when both
  sizes are even or both odd), and within half a context pixel otherwise. Windows of
  neighbouring tiles lie on one grid, so they share storage segments and their DCT scaling.
- **Edges.** A window reaching past the slide is not moved: its pixels off the slide are set
  to the dataset's ``fill_value`` (white by default, the slide background), and the part on
  the slide is given as a box ``(x0, y0, x1, y1)`` in the tile's pixels (``x1``/``y1``
  exclusive): a pixel is on the slide when its centre is.
- **Large windows.** A scale coarser than the slide's coarsest level reads a window larger than
  the level (``read_size`` = size x pitch). Such a window, or any larger than
  `BOUNDED_EDGE`, is read as the part on the level only, in strips of output rows each reduced
  on its own (`read_reduced`): memory stays bounded by a strip, whatever the scale. A scale
  whose window is more than `MAX_WINDOW_OVER_SLIDE` times the slide's larger side is refused
  (the slide would be a few pixels of it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from wsi_loader.config import DatasetConfig, validate
from wsi_loader.errors import ConfigError, ResolutionError
from wsi_loader.index._geometry import plan_read
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import SlideRecord
from wsi_loader.slides._base import (
    MAX_PLAUSIBLE_MPP,
    MIN_PLAUSIBLE_MPP,
    RGBArray,
    SlideMeta,
    SlideReader,
    l0_to_level,
    level_to_l0,
    resize,
)

Scale = tuple[float, int]  # (mpp, size)
Box = tuple[int, int, int, int]  # (x0, y0, x1, y1) of the on-slide part, in tile pixels
BOUNDED_EDGE = 4096  # a window edge (level pixels) past which it is read in strips
STRIP_BYTES = 32 * 2**20  # level pixels (RGBA) read at once by `read_reduced`
MAX_WINDOW_OVER_SLIDE = 16  # a context window this many times the slide's side is refused


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


@dataclass(frozen=True)
class ContextPlan:
    """How one context scale is read on one slide (by the reader that reads it)."""

    level: int
    downsample: float  # of ``level`` from level 0
    read_size: int  # window edge in level pixels
    size: int  # tile edge in output pixels
    level_width: int
    level_height: int

    def place(self, centre_x: float, centre_y: float) -> tuple[int, int]:
        """The window's top-left in level pixels for a centre in level-0 pixels."""
        pitch = self.read_size / self.size  # level pixels per output pixel
        half = self.size / 2

        def axis(centre: float) -> int:
            # the grid pixel the window starts at; the 1e-9 keeps exact halves rounding up
            # where float division lands a hair below them
            first = math.floor(centre / self.downsample / pitch - half + 0.5 + 1e-9)
            return round(first * pitch)

        return axis(centre_x), axis(centre_y)

    def inside(self, l_x: int, l_y: int) -> Box:
        """The part of the window at ``(l_x, l_y)`` that is on the slide, in output pixels: a
        pixel is on it when its centre is (``0 <= l_x + (i + 0.5) * q < width``)."""
        s, r = self.size, self.read_size

        def axis(start: int, length: int) -> tuple[int, int]:
            first = _ceil_div(-2 * start * s - r, 2 * r)
            stop = _ceil_div(2 * (length - start) * s - r, 2 * r)
            return min(max(first, 0), s), min(max(stop, 0), s)

        x0, x1 = axis(l_x, self.level_width)
        y0, y1 = axis(l_y, self.level_height)
        return (x0, y0, max(x0, x1), max(y0, y1))


def main_centre(
    meta: SlideMeta, l0_x: int, l0_y: int, level: int, read_size: int
) -> tuple[float, float]:
    """The centre of an index row's window in level-0 pixels (from its level pixels, which
    readers map with `l0_to_level`)."""
    ds = meta.level_downsamples[level]
    return (
        (l0_to_level(l0_x, ds) + read_size / 2) * ds,
        (l0_to_level(l0_y, ds) + read_size / 2) * ds,
    )


def manifest_mpp(record: SlideRecord) -> float | None:
    """The MPP a manifest gave the slide (used as given), else None (the slide's own)."""
    return record.mpp if record.mpp_source == "manifest" else None


def plan_context(
    meta: SlideMeta, scales: Sequence[Scale], tolerance: float, slide_mpp: float | None
) -> list[ContextPlan]:
    """One `ContextPlan` per scale for a slide read through a reader with ``meta``. Raises
    `ResolutionError` when the slide cannot serve a scale (no MPP, or coarser than it)."""
    plans = []
    for mpp, size in scales:
        try:
            plan = plan_read(meta, size, size, mpp=mpp, tolerance=tolerance, slide_mpp=slide_mpp)
        except ResolutionError as exc:
            raise ResolutionError(f"context scale {mpp:g} um/px: {exc}") from exc
        width, height = meta.level_dimensions[plan.level]
        plans.append(
            ContextPlan(plan.level, plan.level_downsample, plan.read_size, size, width, height)
        )
    return plans


def slide_problem(record: SlideRecord, scales: Sequence[Scale], tolerance: float) -> str | None:
    """Why a slide cannot serve the context scales, from its record alone (no open): it has
    no usable MPP, or a scale is finer than its scan beyond the tolerance."""
    mpp = record.mpp
    if mpp is None or not (
        record.mpp_source == "manifest" or MIN_PLAUSIBLE_MPP <= mpp <= MAX_PLAUSIBLE_MPP
    ):
        return "no usable MPP (context scales are in um/px)"
    finest = min(scale_mpp for scale_mpp, _ in scales)
    if finest < mpp * (1 - tolerance):
        return f"scanned at {mpp:.4g} um/px, coarser than the context scale {finest:g} um/px"
    side = max(record.width or 0, record.height or 0) * mpp
    for scale_mpp, size in scales:
        if side > 0 and scale_mpp * size > MAX_WINDOW_OVER_SLIDE * side:
            return (
                f"the context scale ({size} px at {scale_mpp:g} um/px, {scale_mpp * size:.4g} "
                f"um across) is more than {MAX_WINDOW_OVER_SLIDE} times the slide "
                f"({side:.4g} um across)"
            )
    return None


def recorded_context(index: SlideIndex) -> list[Scale]:
    """The context scales the index records as its default (``index --context``), checked
    as any option is."""
    recorded = index.params.get("context") or []
    scales: list[Scale] = validate(DatasetConfig, {"context": recorded}, prefix="index").context
    return scales or []


def check_context(index: SlideIndex, scales: Sequence[Scale]) -> None:
    """Refuse context scales some slide of ``index`` (with tiles) cannot serve, naming them,
    before any worker starts."""
    if not scales:
        return
    tolerance = float(index.params.get("mpp_tolerance", 0.1))
    starts = index.slide_starts()
    problems = [
        (record.path, problem)
        for i, record in enumerate(index.slides)
        if starts[i + 1] > starts[i]
        and (problem := slide_problem(record, scales, tolerance)) is not None
    ]
    if problems:
        named = "; ".join(f"{path}: {problem}" for path, problem in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ConfigError(
            f"{len(problems)} slides cannot serve the context scales {list(scales)}: {named}"
            f"{more}. Choose coarser scales, or leave those slides out (split=, an index "
            "without them)",
            key="context",
            value=list(scales),
        )


def fill_outside(tile: npt.NDArray[np.uint8], box: Box, value: int) -> None:
    """Set the pixels of ``tile`` outside ``box`` (off the slide) to ``value``."""
    x0, y0, x1, y1 = box
    size_y, size_x = tile.shape[:2]
    if (x0, y0, x1, y1) == (0, 0, size_x, size_y):
        return
    tile[:y0] = value
    tile[y1:] = value
    tile[y0:y1, :x0] = value
    tile[y0:y1, x1:] = value


def needs_bounded_read(meta: SlideMeta, x: int, y: int, level: int, read: int, size: int) -> bool:
    """Whether a window of ``read`` level pixels shrunk to ``size`` goes through
    `read_reduced`: it is larger than `BOUNDED_EDGE`, or larger than the level with less than
    half of it on the level (a scale coarser than the slide's coarsest level)."""
    if read <= size:
        return False
    if read > BOUNDED_EDGE:
        return True
    ds = meta.level_downsamples[level]
    width, height = meta.level_dimensions[level]
    l_x, l_y = l0_to_level(x, ds), l0_to_level(y, ds)
    on_x = max(0, min(l_x + read, width) - max(l_x, 0))
    on_y = max(0, min(l_y + read, height) - max(l_y, 0))
    return (read > width or read > height) and 2 * on_x * on_y < read * read


def read_reduced(
    reader: SlideReader, x: int, y: int, level: int, read: int, size: int, fill: int
) -> RGBArray:
    """The window ``(x, y)`` (level 0), ``read`` pixels of ``level`` across, shrunk to
    ``size``, as the whole window's bilinear resize would give it, reading only the output
    pixels that touch the level, a strip of rows at a time (each strip read with one output
    pixel of margin around it, so the filter sees what it would in the whole window). Pixels
    off the level are ``fill`` (the caller fills them again by their centres)."""
    meta = reader.meta
    ds = meta.level_downsamples[level]
    width, height = meta.level_dimensions[level]
    l_x, l_y = l0_to_level(x, ds), l0_to_level(y, ds)
    q = read / size  # level pixels per output pixel

    def span(start: int, length: int) -> tuple[int, int]:
        first = max(0, math.floor(-start / q))
        stop = min(size, math.ceil((length - start) / q))
        return first, max(first, stop)

    (c0, c1), (r0, r1) = span(l_x, width), span(l_y, height)
    out = np.full((size, size, 3), fill, dtype=np.uint8)
    if c1 <= c0 or r1 <= r0:
        return out
    left, right = int(c0 > 0), int(c1 < size)  # one output pixel of margin inside the window
    cols = c1 - c0 + left + right
    level_w = round(cols * q)
    rows_per_strip = max(1, int(STRIP_BYTES / (4 * level_w * q)) - 2)
    for top in range(r0, r1, rows_per_strip):
        bottom = min(r1, top + rows_per_strip)
        above, below = int(top > 0), int(bottom < size)
        rows = bottom - top + above + below
        sx, sy = l_x + round((c0 - left) * q), l_y + round((top - above) * q)
        pixels = reader.read_region(
            level_to_l0(sx, ds), level_to_l0(sy, ds), level, level_w, round(rows * q)
        )
        strip = resize(pixels, cols, rows)
        out[top:bottom, c0:c1] = strip[above : rows - below, left : cols - right]
    return out
