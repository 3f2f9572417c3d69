"""Deep Zoom geometry of one slide: which pixels of which slide level make each tile.

Deep Zoom levels halve the level-0 image (rounding up) down to 1 x 1 px, as OpenSlide's
`deepzoom.py` lays them out; level ``z`` of ``n`` is ``2 ** (n - 1 - z)`` times smaller than
level 0 (its ``downsample``). Tiles are ``tile_size`` squares without overlap, the last column
and row cut to the level's edge. Coordinate frames are named as everywhere in this library:
``z_*`` Deep Zoom level pixels, ``l_*`` slide level pixels, ``l0_*`` level-0 pixels.

A tile is read from the coarsest slide level at least as fine as its Deep Zoom level. A slide
level whose size is a Deep Zoom level's (within a pixel: Aperio's levels are 4.0002x, not 4x,
apart) is taken as that level, pixel for pixel, so a tile there is exactly a stored tile when
the tile size is the storage tile size, and tiles of finer levels are stored tiles shrunk by a
power of two (what libjpeg's DCT scaling does best).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from wsi_loader.slides._base import level_to_l0

# A slide level this much coarser than asked is still "at least as fine" (downsamples written
# with rounding: 4.0002 for 4)
DOWNSAMPLE_SLACK = 1.01
# Beyond this shrink factor a tile is not read from the slide directly (a window of 8 x 8
# tiles is the most worth decoding for one); see `Plan.kind`
MAX_DIRECT_SHRINK = 8


def deep_zoom_sizes(width: int, height: int) -> list[tuple[int, int]]:
    """(width, height) of every Deep Zoom level, 1 x 1 px first, level 0's size last."""
    sizes = [(width, height)]
    while sizes[-1] != (1, 1):
        w, h = sizes[-1]
        sizes.append((max(1, math.ceil(w / 2)), max(1, math.ceil(h / 2))))
    return sizes[::-1]


class Source(Enum):
    """Where a tile's pixels come from."""

    SLIDE = "slide"  # a window of one slide level, shrunk by at most MAX_DIRECT_SHRINK
    OVERVIEW = "overview"  # the slide's overview image (the coarse levels of a flat slide)
    CHILDREN = "children"  # the four tiles of the next finer Deep Zoom level, halved


@dataclass(frozen=True)
class Plan:
    """How to make tile ``(z, col, row)``: its size, and for `Source.SLIDE` the window."""

    source: Source
    z: int
    col: int
    row: int
    z_w: int  # the tile's size in pixels (the last column and row are smaller)
    z_h: int
    level: int = 0  # slide level read (SLIDE)
    l0_x: int = 0  # the window's top-left, level-0 pixels (SLIDE)
    l0_y: int = 0
    l_w: int = 0  # the window's size in slide level pixels (SLIDE)
    l_h: int = 0
    l_x: int = 0  # the window's top-left in slide level pixels (SLIDE)
    l_y: int = 0
    stored: bool = False  # the window is exactly one stored tile (worth passing through)


@dataclass(frozen=True)
class DeepZoom:
    """The Deep Zoom pyramid of a slide, from its level sizes and downsamples.

    ``storage_tiles`` is each slide level's storage tile size ((0, 0) when unknown);
    ``overview_size`` the longest side of the slide's overview image (what coarse levels come
    from when the slide has no level coarse enough).
    """

    width: int
    height: int
    tile_size: int
    level_dimensions: tuple[tuple[int, int], ...]
    level_downsamples: tuple[float, ...]
    storage_tiles: tuple[tuple[int, int], ...] = ()
    overview_size: int = 2048

    def __post_init__(self) -> None:
        if self.tile_size < 1:
            raise ValueError(f"tile_size must be >= 1, got {self.tile_size}")
        if self.width < 1 or self.height < 1:
            raise ValueError(f"a slide of {self.width}x{self.height} px has no pixels")

    @cached_property
    def sizes(self) -> list[tuple[int, int]]:
        """(width, height) of every Deep Zoom level (`deep_zoom_sizes`)."""
        return deep_zoom_sizes(self.width, self.height)

    @property
    def levels(self) -> int:
        return len(self.sizes)

    def downsample(self, z: int) -> int:
        """Level-0 pixels per pixel of Deep Zoom level ``z``."""
        return int(2 ** (self.levels - 1 - z))

    def tiles(self, z: int) -> tuple[int, int]:
        """(columns, rows) of Deep Zoom level ``z``."""
        w, h = self.sizes[z]
        return math.ceil(w / self.tile_size), math.ceil(h / self.tile_size)

    def has_tile(self, z: int, col: int, row: int) -> bool:
        """Whether the tile exists (bounds check of a request)."""
        if not 0 <= z < self.levels:
            return False
        cols, rows = self.tiles(z)
        return 0 <= col < cols and 0 <= row < rows

    def matching_level(self, level: int) -> int | None:
        """The Deep Zoom level of the same size as slide level ``level`` (within a pixel)."""
        l_w, l_h = self.level_dimensions[level]
        for z, (z_w, z_h) in enumerate(self.sizes):
            if abs(z_w - l_w) <= 1 and abs(z_h - l_h) <= 1:
                return z
        return None

    def best_level(self, z: int) -> int:
        """The coarsest slide level at least as fine as Deep Zoom level ``z``."""
        wanted = self.downsample(z) * DOWNSAMPLE_SLACK
        fine_enough = [i for i, ds in enumerate(self.level_downsamples) if ds <= wanted]
        return max(fine_enough, key=lambda i: self.level_downsamples[i], default=0)

    def shrink(self, z: int, level: int) -> float:
        """Slide level pixels per Deep Zoom pixel when level ``z`` is read from ``level``: an
        exact power of two for a slide level of a Deep Zoom level's size."""
        same = self.matching_level(level)
        if same is not None and same >= z:
            return float(2 ** (same - z))
        return self.downsample(z) / self.level_downsamples[level]

    def plan(self, z: int, col: int, row: int) -> Plan:
        """How to make tile ``(z, col, row)`` (which must exist: `has_tile`)."""
        z_w_level, z_h_level = self.sizes[z]
        z_x, z_y = col * self.tile_size, row * self.tile_size
        z_w = min(self.tile_size, z_w_level - z_x)
        z_h = min(self.tile_size, z_h_level - z_y)
        level = self.best_level(z)
        shrink = self.shrink(z, level)
        if shrink <= MAX_DIRECT_SHRINK:
            ds = self.level_downsamples[level]
            l_x, l_y = round(z_x * shrink), round(z_y * shrink)
            l_w, l_h = round(z_w * shrink), round(z_h * shrink)
            tile_w, tile_h = (
                self.storage_tiles[level] if level < len(self.storage_tiles) else (0, 0)
            )
            stored = (
                shrink == 1
                and z_w == z_h == self.tile_size == tile_w == tile_h
                and l_x % tile_w == 0
                and l_y % tile_h == 0
            )
            return Plan(
                Source.SLIDE,
                z,
                col,
                row,
                z_w,
                z_h,
                level,
                level_to_l0(l_x, ds),
                level_to_l0(l_y, ds),
                l_w,
                l_h,
                l_x,
                l_y,
                stored,
            )
        if max(z_w_level, z_h_level) <= self.overview_size:
            return Plan(Source.OVERVIEW, z, col, row, z_w, z_h)
        return Plan(Source.CHILDREN, z, col, row, z_w, z_h)

    def pieces(self, plan: Plan) -> list[tuple[int, int, int, int, int, int, int, int]]:
        """The window of a `Source.SLIDE` plan cut at the slide level's storage tile edges
        (256 px squares when they are unknown): per piece, its level box (x, y, width,
        height) and the part of the tile it makes (x0, y0, x1, y1), so a tile across a broken
        stored tile can be made of every piece that reads."""
        tile_w, tile_h = (
            self.storage_tiles[plan.level] if plan.level < len(self.storage_tiles) else (0, 0)
        )
        step_x, step_y = tile_w or 256, tile_h or 256
        sx, sy = plan.z_w / plan.l_w, plan.z_h / plan.l_h
        found = []
        for y in range(plan.l_y // step_y * step_y, plan.l_y + plan.l_h, step_y):
            for x in range(plan.l_x // step_x * step_x, plan.l_x + plan.l_w, step_x):
                x0, y0 = max(x, plan.l_x), max(y, plan.l_y)
                x1 = min(x + step_x, plan.l_x + plan.l_w)
                y1 = min(y + step_y, plan.l_y + plan.l_h)
                zx0, zx1 = round((x0 - plan.l_x) * sx), round((x1 - plan.l_x) * sx)
                zy0, zy1 = round((y0 - plan.l_y) * sy), round((y1 - plan.l_y) * sy)
                if zx1 > zx0 and zy1 > zy0:
                    found.append((x0, y0, x1 - x0, y1 - y0, zx0, zy0, zx1, zy1))
        return found

    def overview_box(
        self, plan: Plan, overview_w: int, overview_h: int
    ) -> tuple[float, float, float, float]:
        """The box of an overview image of ``overview_w`` x ``overview_h`` px (the whole
        slide) that tile ``plan`` shows, in overview pixels (left, top, right, bottom)."""
        z_w_level, z_h_level = self.sizes[plan.z]
        sx, sy = overview_w / z_w_level, overview_h / z_h_level
        z_x, z_y = plan.col * self.tile_size, plan.row * self.tile_size
        return (z_x * sx, z_y * sy, (z_x + plan.z_w) * sx, (z_y + plan.z_h) * sy)

    def children(self, plan: Plan) -> list[tuple[int, int, int, int]]:
        """(column, row, x, y) of the tiles of level ``z + 1`` that make tile ``plan``, with
        where each goes in the (2 x size) picture they make together."""
        cols, rows = self.tiles(plan.z + 1)
        return [
            (c, r, (c - 2 * plan.col) * self.tile_size, (r - 2 * plan.row) * self.tile_size)
            for r in (2 * plan.row, 2 * plan.row + 1)
            for c in (2 * plan.col, 2 * plan.col + 1)
            if c < cols and r < rows
        ]

    def dzi(self, fmt: str = "jpeg") -> str:
        """The ``.dzi`` descriptor."""
        return (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            '<Image xmlns="http://schemas.microsoft.com/deepzoom/2008" '
            f'Format="{fmt}" Overlap="0" TileSize="{self.tile_size}">'
            f'<Size Width="{self.width}" Height="{self.height}"/></Image>'
        )
