"""Marker ink laid over tissue is pen, not a fold: a fold is the tissue's own hue, denser."""

from __future__ import annotations

from collections.abc import Callable

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


def flags_and_shares(
    image: npt.NDArray[np.uint8],
) -> tuple[
    dict[str, npt.NDArray[np.bool_]], Callable[[npt.NDArray[np.bool_]], npt.NDArray[np.float64]]
]:
    """QC of ``image`` as a slide's picture in tiles of `TILE_PX`: each rule's flags, and the
    share of each tile a mask covers (the truth's tile shares)."""
    h, w = image.shape[:2]
    ys, xs = np.meshgrid(np.arange(0, h, TILE_PX), np.arange(0, w, TILE_PX), indexing="ij")
    tiles = TileBoxes(xs.ravel().astype(np.int64), ys.ravel().astype(np.int64), TILE_PX)
    rule = pixel_rule(image, "brightfield")
    result = qc.measure(
        LowResolution(image, 0, (w, h)), rule, tiles, UM_PER_PX, None,
        tissue_mask(image, rule, None),
    )  # fmt: skip

    def share(mask: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
        at = zip(xs.ravel().tolist(), ys.ravel().tolist(), strict=True)
        return np.array([mask[y : y + TILE_PX, x : x + TILE_PX].mean() for x, y in at])

    return qc.flags(result.columns), share


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
    flagged, share = flags_and_shares(image)

    over_tissue = share(stroke & tissue) >= 0.5
    clean = (share(stroke) == 0) & (share(tissue) == 1)
    assert over_tissue.sum() >= 20 and clean.sum() >= 100
    assert flagged["pen"][over_tissue].all()
    assert not flagged["fold"][over_tissue].any()
    assert not (flagged["pen"] | flagged["fold"])[clean].any()  # the tissue beside it is clean


H_DARK = np.array([0.65, 0.70, 0.29]) / np.linalg.norm([0.65, 0.70, 0.29])  # another lab's H&E
E_PALE = np.array([0.30, 0.80, 0.45]) / np.linalg.norm([0.30, 0.80, 0.45])
MARKERS = {"blue": (40, 70, 180), "black": (30, 30, 32)}  # the other painter's inks


def test_a_second_layer_of_dark_h_tissue_is_no_ink() -> None:
    """Stained dark in haematoxylin (another lab's H&E, H x1.4, E x0.7, as validate_qc's
    rendering): a dense core in pale stroma, a fold of the core lying on itself (its optical
    density doubled, in the core's proportions) and blue and black marker strokes laid over
    the core at 75% from the glass. The doubled core passes histolab's blue triples (red and
    green under 60, blue over 120) but keeps the core's hue: it is a fold, not ink (the
    rule before took a third of it as ink and so lost the fold); the strokes are ink."""
    rng = np.random.default_rng(1)
    h, w = 320, 480
    tissue = np.zeros((h, w), dtype=bool)
    tissue[40:280, 40:440] = True
    core = np.zeros((h, w), dtype=bool)
    core[64:256, 140:400] = True
    fold = np.zeros((h, w), dtype=bool)
    fold[144:160, 176:352] = True  # 128 um wide, 1.4 mm long, all over the core
    od = np.where(tissue[..., None], 0.3 * E_PALE, 0.0)
    od = np.where(core[..., None], 0.52 * H_DARK + 0.01 * E_PALE, od)
    od *= rng.uniform(0.96, 1.04, (h, w, 1))
    od[fold] *= 2.0 * rng.uniform(0.97, 1.03, (int(fold.sum()), 1))
    image = np.clip(245 * 10**-od + 0.5, 0, 255)
    image[~tissue] = 245
    strokes = {}
    for (name, colour), top in zip(MARKERS.items(), (96, 208), strict=True):
        stroke = np.zeros((h, w), dtype=bool)
        stroke[top : top + 12, 0:300] = True  # 96 um wide, from the glass over the core
        image[stroke] = 0.25 * image[stroke] + 0.75 * np.asarray(colour, dtype=np.float64)
        strokes[name] = stroke
    image = (image + 0.5).astype(np.uint8)
    flagged, share = flags_and_shares(image)

    folded = share(fold) >= 0.5
    assert folded.sum() >= 10
    assert not flagged["pen"][folded].any()
    assert flagged["fold"][folded].mean() >= 0.8  # ...but a fold
    assert not flagged["fold"][share(fold) == 0].any()
    for name, stroke in strokes.items():
        over_core = share(stroke & core) >= 0.5
        assert over_core.sum() >= 8, name
        assert flagged["pen"][over_core].all(), name
