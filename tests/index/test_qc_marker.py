"""Marker ink laid over tissue is pen, not a fold: a fold is the tissue's own hue, denser."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from wsi_loader.index import _qc as qc
from wsi_loader.index._lowres import LowResolution, TileBoxes
from wsi_loader.index._tissue import pixel_rule, tissue_mask

GLASS = 242
TISSUE = (210, 165, 193)  # HistoQC's pen_red slide: its eosin-rich tissue
RED_MARKER = (202, 56, 78)  # ...and its red marker over glass
UM_PER_PX = 8.0  # the QC picture's resolution
TILE_PX = 16  # 128 um tiles (256 px at 0.5 um/px)


def density(rgb: tuple[int, int, int]) -> npt.NDArray[np.float64]:
    return -np.log10(np.maximum(np.asarray(rgb, np.float64), 1.0) / 255.0)


def test_red_marker_over_tissue_is_pen_not_fold() -> None:
    """A red marker stroke running from glass over pink tissue (the marker's density added
    to the tissue's, as on HistoQC's pen_red slide, where 101 tiles of it were folds): red
    over eosin is nearly the tissue's colour and twice as dense, but redder."""
    rng = np.random.default_rng(0)
    h, w = 320, 480
    tissue = np.zeros((h, w), dtype=bool)
    tissue[40:280, 120:440] = True
    stroke = np.zeros((h, w), dtype=bool)
    stroke[140:180, 20:300] = True  # 320 um wide, half of it over tissue
    od = np.where(tissue[..., None], density(TISSUE) * rng.uniform(0.8, 1.2, (h, w, 1)), 0.0)
    od += np.where(stroke[..., None], 0.55 * density(RED_MARKER), 0.0)
    image = np.clip(255 * 10**-od + 0.5, 0, 255).astype(np.uint8)
    image[~(tissue | stroke)] = GLASS
    ys, xs = np.meshgrid(np.arange(0, h, TILE_PX), np.arange(0, w, TILE_PX), indexing="ij")
    tiles = TileBoxes(xs.ravel().astype(np.int64), ys.ravel().astype(np.int64), TILE_PX)
    rule = pixel_rule(image, "brightfield")
    result = qc.measure(
        LowResolution(image, 0, (w, h)), rule, tiles, UM_PER_PX, None,
        tissue_mask(image, rule, None),
    )  # fmt: skip
    flagged = qc.flags(result.columns)

    def share(mask: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
        at = zip(xs.ravel().tolist(), ys.ravel().tolist(), strict=True)
        return np.array([mask[y : y + TILE_PX, x : x + TILE_PX].mean() for x, y in at])

    over_tissue = share(stroke & tissue) >= 0.5
    clean = (share(stroke) == 0) & (share(tissue) == 1)
    assert over_tissue.sum() >= 20 and clean.sum() >= 100
    assert flagged["pen"][over_tissue].all()
    assert not flagged["fold"][over_tissue].any()
    assert not (flagged["pen"] | flagged["fold"])[clean].any()  # the tissue beside it is clean
