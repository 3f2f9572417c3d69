"""Synthetic artefacts: masks that agree across pyramid levels, layouts that keep apart, and
painted slides that show what the masks say."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

from tests.conftest import SlideFactory
from wsi_loader.slides import open_slide
from wsi_loader.synthetic import SlideSpec, tissue_of, with_qc_artefacts
from wsi_loader.synthetic._artefacts import (
    BlurredRegion,
    Bubble,
    Fold,
    PenStroke,
    Score,
    coverage,
    score,
    touches,
)

ARTEFACTS = [
    PenStroke(((100.0, 200.0), (900.0, 300.0), (1500.0, 900.0)), 120.0, "green"),
    BlurredRegion((800.0, 800.0), (400.0, 250.0), 4.0),
    Fold(((200.0, 1400.0), (1400.0, 1300.0)), 200.0),
    Bubble((1200.0, 400.0), 300.0, 40.0),
]


@pytest.mark.parametrize("artefact", ARTEFACTS, ids=lambda a: a.kind)
def test_masks_agree_across_levels(artefact: object) -> None:
    """The share a coarse pixel gets is the mean of the fine pixels it covers."""
    fine = coverage(artefact, 0.0, 0.0, 4.0, 512, 512)  # type: ignore[arg-type]
    coarse = coverage(artefact, 0.0, 0.0, 16.0, 128, 128)  # type: ignore[arg-type]
    pooled = fine.reshape(128, 4, 128, 4).mean(axis=(1, 3))
    assert np.abs(pooled - coarse).mean() < 0.01
    assert fine.max() == 1.0 and fine.min() == 0.0


def test_bubble_parts_make_the_whole() -> None:
    bubble = ARTEFACTS[3]
    rim = coverage(bubble, 0.0, 0.0, 4.0, 512, 512, "rim")
    inside = coverage(bubble, 0.0, 0.0, 4.0, 512, 512, "inside")
    whole = coverage(bubble, 0.0, 0.0, 4.0, 512, 512)
    assert np.abs(rim + inside - whole).max() < 0.02


def test_the_standard_layout_keeps_artefacts_apart_and_on_tissue() -> None:
    spec = with_qc_artefacts(SlideSpec(width=20_000, height=15_000, seed=5))
    kinds = [a.kind for a in spec.artefacts]
    assert kinds.count("pen") == 4 and kinds.count("blur") == 3 and {"fold", "bubble"} <= set(kinds)
    inks = {a.ink for a in spec.artefacts if isinstance(a, PenStroke)}
    assert inks == {"blue", "green", "black", "red"}
    for i, a in enumerate(spec.artefacts):
        for b in spec.artefacts[i + 1 :]:
            x0, y0, x1, y1 = _box(b)
            assert not touches(a, x0, y0, x1 - x0, y1 - y0), (a, b)
    mask = tissue_of(spec)
    for a in spec.artefacts:
        centre = a.centre if isinstance(a, BlurredRegion | Bubble) else a.points[len(a.points) // 2]
        assert mask(centre[0], centre[1], 1.0, 1, 1).all()


def _box(artefact: object) -> tuple[float, float, float, float]:
    from wsi_loader.synthetic._artefacts import _bounds

    return _bounds(artefact)  # type: ignore[arg-type]


def test_painted_slide_shows_the_artefacts(make_slide: SlideFactory) -> None:
    """Ink where the stroke is, darker tissue in the fold, less detail where it is blurred."""
    pen = PenStroke(((500.0, 1000.0), (2500.0, 1000.0)), 300.0, "blue")
    blur = BlurredRegion((1500.0, 2300.0), (500.0, 300.0), 6.0)
    spec = SlideSpec(width=3072, height=3072, seed=1, tissue=0.9, artefacts=(pen, blur))
    plain = make_slide(width=3072, height=3072, seed=1, tissue=0.9)
    marked = make_slide(width=3072, height=3072, seed=1, tissue=0.9, artefacts=(pen, blur))
    with open_slide(str(plain)) as a, open_slide(str(marked)) as b:
        clean_ink = a.read_region(1400, 950, 0, 100, 100).astype(float)
        inked = b.read_region(1400, 950, 0, 100, 100).astype(float)
        clean_blur = a.read_region(1400, 2250, 0, 200, 100).astype(float)
        blurred = b.read_region(1400, 2250, 0, 200, 100).astype(float)
        untouched = (a.read_region(100, 100, 0, 64, 64), b.read_region(100, 100, 0, 64, 64))
    assert inked[..., 2].mean() > inked[..., 0].mean() + 60  # blue ink
    assert clean_ink[..., 0].mean() > clean_ink[..., 2].mean()  # pink tissue

    def detail(pixels: np.ndarray) -> float:
        return float(ndimage.laplace(pixels.mean(axis=-1)).var())

    assert detail(blurred) < 0.1 * detail(clean_blur)
    assert np.array_equal(*untouched)
    assert tissue_of(spec)(0, 0, 64.0, 48, 48).mean() > 0.5


def test_scores_count_only_clear_tiles() -> None:
    truth = {
        "pen": np.array([1.0, 0.6, 0.3, 0.01, 0.0]),
        "blur": np.zeros(5),
        "fold": np.zeros(5),
        "bubble": np.zeros(5),
    }
    flagged = np.array([True, False, True, True, False])
    found = score("pen", flagged, truth)
    assert found == Score(positives=2, true_positives=1, false_positives=1, false_negatives=1)
    assert found.precision == 0.5 and found.recall == 0.5


def test_coarse_levels_average_nuclei(make_slide: SlideFactory, tmp_path: Path) -> None:
    """Levels coarser than 1/4 show nuclei as the tint they average to, no dark dots."""
    path = make_slide(width=8192, height=8192, seed=2, tissue=0.9)
    with open_slide(str(path)) as reader:
        levels = reader.meta.level_downsamples
        coarse = reader.read_region(0, 0, len(levels) - 1, 64, 64)
    assert levels[-1] > 4
    darkest = coarse.max(axis=-1)
    assert darkest.min() > 150  # nucleus colour (88, 58, 140) averaged in, never alone


def test_the_other_painter_blends_ink_and_lays_a_second_layer() -> None:
    """`_other_artefacts`: ink is 75% of a stroke's pixels over the stain (not a filter),
    and a fold multiplies the tissue by a second layer of tissue (optical densities add)."""
    from wsi_loader.synthetic._artefacts import Fold, PenStroke
    from wsi_loader.synthetic._other_artefacts import INK_COLOURS, paint_other_artefacts

    tissue_colour = np.array([200, 140, 180], np.float32)
    tile = np.broadcast_to(tissue_colour, (64, 64, 3)).astype(np.uint8)
    on = np.ones((64, 64), bool)

    def neighbour(x: float, y: float) -> np.ndarray:
        return tile.copy()

    stroke = PenStroke(((0.0, 32.0), (64.0, 32.0)), 20.0, "green")
    inked = paint_other_artefacts(tile, [stroke], 0, 0, 1.0, on, neighbour)
    expected = 0.25 * tissue_colour + 0.75 * np.array(INK_COLOURS["green"])
    assert np.abs(inked[32, 32] - expected).max() <= 1
    assert (inked[2, 2] == tile[2, 2]).all()  # off the stroke: untouched
    fold = Fold(((0.0, 32.0), (64.0, 32.0)), 20.0)
    folded = paint_other_artefacts(tile, [fold], 0, 0, 1.0, on, neighbour)
    od = -np.log(folded[32, 32] / 245.0)
    assert np.allclose(od, 2 * -np.log(tissue_colour / 245.0), atol=0.02)
