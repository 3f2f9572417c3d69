"""The low-resolution picture of a slide the builder reads once, and per-tile means over it.

Every per-slide analysis at index time (tissue, quality control, stain estimates) works from
this one picture: the lowest pyramid level shrunk to ``mask_max_size``, never level 0 of a
pyramidal slide. `box_means` measures any per-pixel quantity of it (or of any other raster
laid over the slide, such as the stored size of each JPEG tile) over each tile's level-0
footprint, weighting pixels by the share of them the footprint covers, so tiles a few pixels
wide still get exact shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from wsi_loader.slides._base import RGBArray

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class TileBoxes:
    """The tiles of a slide: level-0 top-left corners and the square level-0 footprint."""

    l0_x: npt.NDArray[np.int64]
    l0_y: npt.NDArray[np.int64]
    footprint: float

    def __len__(self) -> int:
        return len(self.l0_x)


@dataclass(frozen=True)
class LowResolution:
    """A slide's low-resolution RGB picture (``image``, read from ``level``) and the slide's
    level-0 size, which place each picture pixel on the slide."""

    image: RGBArray
    level: int
    l0_size: tuple[int, int]

    @property
    def scale(self) -> tuple[float, float]:
        """Picture pixels per level-0 pixel, across and down."""
        h, w = self.image.shape[:2]
        return w / self.l0_size[0], h / self.l0_size[1]

    def tile_means(self, values: npt.NDArray[np.generic], tiles: TileBoxes) -> FloatArray:
        """Mean of a per-pixel quantity of the picture (a bool mask gives shares) over each
        tile's footprint."""
        sx, sy = self.scale
        return box_means(values, sx, sy, tiles)


def box_means(
    values: npt.NDArray[np.generic], sx: float, sy: float, tiles: TileBoxes
) -> FloatArray:
    """Area-weighted mean of a raster (``sx``, ``sy``: raster pixels per level-0 pixel) over
    each tile's footprint; the part of a footprint outside the raster does not count (NaN
    when nothing of it is inside). A stack of rasters ``(k, H, W)`` gives ``(k, tiles)``.

    Exact for a raster of constant pixels: the integral of such a raster from the origin is
    bilinear between pixel corners, so the summed-area table interpolated bilinearly at the
    footprint's fractional corners gives it. O(1) per tile.
    """
    grid = np.asarray(values, dtype=np.float64)
    stacked = grid.ndim == 3
    grid = grid if stacked else grid[None]
    k, h, w = grid.shape
    total = np.zeros((k, h + 1, w + 1), dtype=np.float64)
    total[:, 1:, 1:] = grid.cumsum(1).cumsum(2)
    x0 = np.clip(tiles.l0_x * sx, 0, w)
    x1 = np.clip((tiles.l0_x + tiles.footprint) * sx, 0, w)
    y0 = np.clip(tiles.l0_y * sy, 0, h)
    y1 = np.clip((tiles.l0_y + tiles.footprint) * sy, 0, h)
    inside = (
        _integral(total, x1, y1)
        - _integral(total, x0, y1)
        - _integral(total, x1, y0)
        + _integral(total, x0, y0)
    )
    area = (x1 - x0) * (y1 - y0)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(area > 0, inside / np.where(area > 0, area, 1.0), np.nan)
    # a mean lies within its raster's range (the interpolation rounds a hair past it: -1e-16)
    low = grid.min(axis=(1, 2))[:, None] if grid.size else 0.0
    high = grid.max(axis=(1, 2))[:, None] if grid.size else 0.0
    result = np.clip(means, low, high).astype(np.float32)
    return result if stacked else result[0]


def _integral(
    total: npt.NDArray[np.float64], x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """The summed-area tables ``(k, H + 1, W + 1)`` at fractional (x, y), bilinearly between
    their integer corners: ``(k, points)``."""
    h, w = total.shape[1] - 1, total.shape[2] - 1
    xi = np.minimum(np.floor(x).astype(np.int64), w - 1)
    yi = np.minimum(np.floor(y).astype(np.int64), h - 1)
    fx, fy = x - xi, y - yi
    flat = total.reshape(len(total), -1)
    row = w + 1
    at = yi * row + xi

    def corner(offset: int) -> npt.NDArray[np.float64]:
        picked: npt.NDArray[np.float64] = flat[:, at + offset]
        return picked

    top = corner(0) * (1 - fx) + corner(1) * fx
    bottom = corner(row) * (1 - fx) + corner(row + 1) * fx
    result: npt.NDArray[np.float64] = top * (1 - fy) + bottom * fy
    return result
