"""A slide's stain sample: the pixels a slide's stain is estimated from (`slide_estimate`),
the builder's mask image when it is the read level at full resolution, else a few storage
tiles over tissue of the read level (`read_tissue_sample`), and the slide record's stain
columns from them (`stain_columns`). The estimate itself is `_stain_estimates`."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import SlideError
from wsi_loader.index._stain_estimates import StainEstimate, estimate_stain, evenly
from wsi_loader.slides._base import SlideReader, level_to_l0

log = logging.getLogger(__name__)

SAMPLE_WINDOWS = 16  # storage tiles read at full resolution when the mask image is too coarse
SAMPLE_PIXELS = 1 << 17  # of the sampled tiles' tissue pixels, evenly spread
SAMPLE_WINDOW_MAX = 512  # a larger storage tile (or a strip) is sampled in windows this wide


def slide_estimate(
    reader: SlideReader,
    image: npt.NDArray[np.uint8],
    tissue: npt.NDArray[np.bool_],
    mask_level: int,
    read_level: int,
) -> StainEstimate | str:
    """A slide's stain from the builder's mask image (``image`` of level ``mask_level`` and its
    ``tissue`` mask) when that image is the read level at full resolution, else from
    `SAMPLE_WINDOWS` of the read level's storage tiles over tissue at full resolution: the
    statistics a tile is normalised with must be those of pixels like its own (see the
    module's docstring; a sample that cannot be read falls back to the image)."""
    l_w, l_h = reader.meta.level_dimensions[mask_level]
    if read_level != mask_level or image.shape[:2] != (l_h, l_w):
        try:
            pixels, windows = read_tissue_sample(reader, read_level, tissue)
        except SlideError as exc:  # a corrupt tile: the mask image still has the colours
            log.debug("stain sample of %s unreadable (%s): the mask image", reader.path, exc)
        else:
            if windows:  # evenly fewer: ~1M pixels cost 200 ms, and 2^17 estimate as well
                sample = evenly(pixels, SAMPLE_PIXELS)
                return estimate_stain(sample, source=f"level {read_level}, {windows} tiles")
    return estimate_stain(image, tissue, source=f"level {mask_level}")


def read_tissue_sample(
    reader: SlideReader, level: int, tissue: npt.NDArray[np.bool_], count: int = SAMPLE_WINDOWS
) -> tuple[npt.NDArray[np.uint8], int]:
    """The tissue pixels ``(n, 3)`` of up to ``count`` storage tiles of ``level`` (windows at
    most `SAMPLE_WINDOW_MAX` wide), read at full resolution, and how many were read. ``tissue``
    is the level's mask at any scale; the windows are those at least half tissue (the most
    tissue when none is), evenly spread in raster order: deterministic, and one decode each."""
    from wsi_loader.index._tissue import tile_fractions

    meta = reader.meta
    l_w, l_h = meta.level_dimensions[level]
    ds = meta.level_downsamples[level]
    tile_w, tile_h = meta.tile_sizes[level] if level < len(meta.tile_sizes) else (0, 0)
    win_w = tile_w if 0 < tile_w <= SAMPLE_WINDOW_MAX else min(256, l_w)
    win_h = tile_h if 0 < tile_h <= SAMPLE_WINDOW_MAX else min(256, l_h)
    l_x, l_y = (a.ravel() for a in np.meshgrid(np.arange(0, l_w, win_w), np.arange(0, l_h, win_h)))
    # the fractions in level pixels, with the level's size as the "level-0" frame
    fraction = tile_fractions(tissue, (l_w, l_h), l_x, l_y, float(max(win_w, win_h)))
    candidates = np.flatnonzero(fraction >= 0.5)
    if len(candidates) < count:
        candidates = np.sort(np.argsort(-fraction, kind="stable")[:count])
        candidates = candidates[fraction[candidates] > 0]
    if not len(candidates):
        return np.zeros((0, 3), np.uint8), 0
    picks = candidates[np.unique(np.linspace(0, len(candidates) - 1, count).round().astype(int))]
    h_m, w_m = tissue.shape
    found = []
    for i in picks.tolist():
        x, y = int(l_x[i]), int(l_y[i])
        w, h = min(win_w, l_w - x), min(win_h, l_h - y)
        window = reader.read_region(level_to_l0(x, ds), level_to_l0(y, ds), level, w, h)
        rows = np.minimum((y + np.arange(h)) * h_m // l_h, h_m - 1)
        cols = np.minimum((x + np.arange(w)) * w_m // l_w, w_m - 1)
        found.append(window[tissue[rows][:, cols]])
    return np.concatenate(found), len(picks)


def stain_columns(
    reader: SlideReader,
    image: npt.NDArray[np.uint8],
    tissue: npt.NDArray[np.bool_],
    mask_level: int,
    read_level: int,
) -> dict[str, Any]:
    """The slide record's ``stain`` and ``stain_error`` fields (`slide_estimate`'s arguments;
    an estimate that fails is a reason, never an exception)."""
    try:
        found = slide_estimate(reader, image, tissue, mask_level, read_level)
    except (ValueError, np.linalg.LinAlgError) as exc:  # a degenerate image (all one colour)
        found = f"stain estimate failed: {exc}"
    if isinstance(found, str):
        return {"stain": None, "stain_error": found}
    return {"stain": found.as_json(), "stain_error": None}
