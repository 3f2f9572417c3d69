"""How sharp each tile is, measured without decoding the level it is read from.

A JPEG (or any compressed) tile's size is the cost of coding its DCT coefficients: blur
removes the high frequencies, whose coefficients are most of the bytes of textured tissue,
so an out-of-focus tile codes in far fewer bytes than a sharp one of the same tissue. The
builder gets every tile's byte count from the file's layout (`KnowsStoredSizes`), at no
cost: no byte of pixel data is read, let alone entropy-decoded. Slides whose readers cannot
say (OpenSlide formats: NDPI, MRXS, DICOM...) fall back to the variance of the Laplacian on
the finest level of at most `LAPLACIAN_MAX_PIXELS`.

Either raw measure depends on how much of a tile is tissue and on the scanner's JPEG
quality, so `relative_focus` states it per tissue and relative to the slide's own typical
tissue: 1.0 is as sharp as the slide's typical tissue, 0.3 a third of its detail. A slide
entirely out of focus is therefore not flagged by the relative rule; its summary keeps the
absolute figure (``focus_reference``) to compare slides by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from wsi_loader.index._lowres import FloatArray, TileBoxes, box_means
from wsi_loader.index._tissue import read_mask_image
from wsi_loader.slides._base import KnowsStoredSizes, SlideReader, supports

LAPLACIAN_MAX_PIXELS = 4_000_000  # the fallback reads a level of at most this many pixels
MIN_TISSUE_SHARE = 0.25  # tiles with less tissue than this get no focus (NaN)
GLASS_SHARE = 0.05  # tiles with less tissue than this measure the glass's own level


@dataclass(frozen=True)
class Sharpness:
    """A raw sharpness per tile and what it was measured from."""

    raw: FloatArray  # bits per level pixel (stored sizes), or mean squared Laplacian
    source: str  # e.g. "stored bytes, level 0" or "laplacian, level 2"


def measure_sharpness(reader: SlideReader, level: int, tiles: TileBoxes) -> Sharpness | None:
    """Each tile's raw sharpness at the level it is read from: stored bytes when the reader
    knows them, else the Laplacian of the finest level small enough to read (None when no
    level is finer than the tiles' own size in pixels, nothing to measure)."""
    meta = reader.meta
    if supports(reader, KnowsStoredSizes):
        sizes = reader.stored_sizes(level)
        if sizes is not None:
            ds = meta.level_downsamples[level]
            bits = sizes.counts.astype(np.float64) * 8.0 / (sizes.tile_w * sizes.tile_h)
            raw = box_means(bits, 1.0 / (sizes.tile_w * ds), 1.0 / (sizes.tile_h * ds), tiles)
            return Sharpness(raw, f"stored bytes, level {level}")
    finest = next(
        (
            i
            for i in range(level, meta.level_count)
            if math.prod(meta.level_dimensions[i]) <= LAPLACIAN_MAX_PIXELS
        ),
        None,
    )
    if finest is None or tiles.footprint / meta.level_downsamples[finest] < 8:
        return None
    size = max(meta.level_dimensions[finest])
    image, _ = read_mask_image(reader, size, finest)
    grey = image.astype(np.float32).mean(axis=-1)
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    energy = ndimage.laplace(grey) ** 2
    h, w = grey.shape
    raw = box_means(energy, w / meta.dimensions[0], h / meta.dimensions[1], tiles)
    return Sharpness(raw, f"laplacian, level {finest}")


@dataclass(frozen=True)
class Focus:
    """Per-tile focus relative to the slide's typical tissue, and the slide's figures."""

    focus: FloatArray  # 1.0: as sharp as the slide's typical tissue; NaN: too little tissue
    reference: float  # raw sharpness of the slide's typical tissue (NaN: none found)
    glass: float  # raw sharpness of its glass


def relative_focus(raw: FloatArray, tissue: FloatArray) -> Focus:
    """Sharpness per unit of tissue, relative to the slide's typical tissue.

    A tile's raw measure is its tissue's and its glass's, by area: ``raw = s * t + (1 - s)
    * g`` with ``s`` its tissue share and ``g`` the glass's level (measured on tiles with
    next to no tissue). So ``t = (raw - (1 - s) g) / s``, divided by the median ``t`` of
    the tiles at least half tissue. Tiles under `MIN_TISSUE_SHARE` tissue get NaN: there is
    too little to judge, and a rule never flags NaN.
    """
    raw = raw.astype(np.float64)
    share = np.nan_to_num(tissue.astype(np.float64), nan=0.0)
    known = np.isfinite(raw)
    glass_tiles = known & (share < GLASS_SHARE)
    glass = float(np.median(raw[glass_tiles])) if glass_tiles.sum() >= 3 else 0.0
    judged = known & (share >= MIN_TISSUE_SHARE)
    per_tissue = np.full(len(raw), np.nan)
    per_tissue[judged] = (raw[judged] - (1.0 - share[judged]) * glass) / share[judged]
    typical = judged & (share >= 0.5)
    if typical.sum() < 5:
        typical = judged
    if not typical.any():
        return Focus(np.full(len(raw), np.nan, dtype=np.float32), math.nan, glass)
    reference = float(np.median(per_tissue[typical]))
    if reference <= 0:
        return Focus(np.full(len(raw), np.nan, dtype=np.float32), reference, glass)
    focus = np.clip(per_tissue / reference, 0.0, None).astype(np.float32)
    return Focus(focus, reference, glass)
