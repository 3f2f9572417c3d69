"""Annotation files we wrote for the real third-party slides, in every format: each
tile's coverage equals the overlap computed by hand (rectangles: interval arithmetic, an
oracle independent of shapely), whichever format describes the shapes."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from wsi_loader.index import SlideIndex, build_index

from .annotation_files import WRITERS, Region, rect

pytestmark = pytest.mark.testdata


def overlap(index: SlideIndex, box: tuple[float, float, float, float]) -> np.ndarray:
    """Share of each tile inside an axis-aligned box, by interval arithmetic."""
    x0, y0, x1, y1 = box
    record = index.slides[0]
    side = (record.read_size or 0) * (record.read_downsample or 1.0)
    tx = np.asarray(index.columns["l0_x"], np.float64)
    ty = np.asarray(index.columns["l0_y"], np.float64)
    wide = np.clip(np.minimum(tx + side, x1) - np.maximum(tx, x0), 0, None)
    high = np.clip(np.minimum(ty + side, y1) - np.maximum(ty, y0), 0, None)
    return wide * high / side**2


def annotate(
    testdata: Path, slide: str, tmp: Path, kind: str, regions: list[Region], **grid: object
) -> SlideIndex:
    notes = tmp / kind
    notes.mkdir()
    write, suffix = WRITERS[kind]
    write(notes / (Path(slide).stem + suffix), regions)
    return build_index(
        [testdata / slide], tmp / f"idx-{kind}", annotations=str(notes), min_tissue=0.0, **grid
    )


@pytest.mark.parametrize("kind", list(WRITERS))
def test_cmu1_aperio_scan(
    testdata: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """CMU-1-Small-Region.svs (2220 x 2967, 240 px JPEG tiles), read at level 0: a tumour
    with a hole, a stroma band across tile borders, and a pen mark reaching off the slide."""
    tumour, hole = (300.0, 410.0, 1210.0, 1330.0), (500.0, 600.0, 700.0, 800.0)
    stroma = (0.0, 1500.5, 2220.0, 1700.25)
    pen = (2000.0, 2800.0, 2400.0, 3100.0)  # clipped to 2000..2220 x 2800..2967
    regions = [
        Region("Tumor", rect(*tumour), [rect(*hole)]),
        Region("Stroma", rect(*stroma)),
        Region("Pen", rect(*pen)),
    ]
    with caplog.at_level(logging.WARNING):
        index = annotate(
            testdata, "CMU-1-Small-Region.svs", tmp_path, kind, regions, tile_size=240, level=0
        )
    assert index.slides[0].status == "ok" and index.classes == ("Pen", "Stroma", "Tumor")
    assert "reach outside the 2220 x 2967 slide and were clipped" in caplog.text
    coverage = index.coverage
    assert coverage is not None
    expected = np.stack(
        [
            overlap(index, (2000.0, 2800.0, 2220.0, 2967.0)),
            overlap(index, stroma),
            overlap(index, tumour) - overlap(index, hole),
        ],
        axis=1,
    )
    np.testing.assert_allclose(coverage, expected, atol=1e-6)
    assert (coverage[:, 2] == 1).sum() > 0 and ((coverage > 0) & (coverage < 1)).any()


def test_ndpi_with_an_aperio_negative_region(testdata: Path, tmp_path: Path) -> None:
    """The Hamamatsu NDPI (0.228 um/px) indexed at 0.5 um/px: tiles are 561 px squares of
    level 0 that do not line up with the annotation, which has a negative (hole) region."""
    body, hole = (100.0, 200.0, 3000.0, 4000.0), (1000.0, 1000.0, 2000.0, 3100.0)
    index = annotate(
        testdata,
        "test3-DAPI-2-(387).ndpi",
        tmp_path,
        "aperio",
        [Region("Tumor", rect(*body), [rect(*hole)])],
        tile_size=256,
        mpp=0.5,
        label_from="annotations",
        min_coverage=0.9,
    )
    assert index.coverage is not None
    expected = overlap(index, body) - overlap(index, hole)
    np.testing.assert_allclose(index.coverage[:, 0], expected, atol=1e-6)
    labelled = index.tile_labels() == index.label_names.index("Tumor")
    np.testing.assert_array_equal(labelled, expected >= 0.9)
    assert labelled.sum() > 0
