"""One rounding rule from grid to reader at non-integer downsamples (TCGA level 1 is 2.0005,
boxes.tiff levels 1-3 are 2, 4.016 and 8.086): every index row reads exactly the level's stored
pixels at ``l0_to_level(l0_x)``, as OpenSlide reads them from the level's origin, and aligned
windows stay one storage tile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openslide
import pytest

from wsi_loader.index._geometry import grid, plan_read
from wsi_loader.slides._base import l0_to_level, level_to_l0
from wsi_loader.slides._tiff import TiffReader

pytestmark = pytest.mark.testdata


@pytest.mark.parametrize("ds", [1.0, 2.0, 2.0005055500659967, 4.016129032258064, 8.0863, 3.7])
def test_the_rule_round_trips(ds: float) -> None:
    for l in range(0, 5000, 7):  # noqa: E741
        assert l0_to_level(level_to_l0(l, ds), ds) == l


@pytest.mark.parametrize(
    ("name", "level", "tile"),
    [
        ("tcga-cr-7395-01a-01-ts1.svs", 1, 256),
        ("boxes.tiff", 1, 32),
        ("boxes.tiff", 2, 16),
        ("boxes.tiff", 3, 8),
    ],
)
def test_index_rows_read_the_levels_own_pixels(
    testdata: Path, name: str, level: int, tile: int
) -> None:
    path = str(testdata / name)
    reader = TiffReader(path)
    plan = plan_read(reader.meta, tile, tile, level=level)
    xs, ys = grid(reader.meta, plan)
    assert len(xs) >= 12
    with openslide.OpenSlide(path) as slide:
        w, h = slide.level_dimensions[level]
        # the level from its origin: OpenSlide's exact pixels (a read at a fractional level
        # position is interpolated by OpenSlide)
        whole = np.asarray(slide.read_region((0, 0), level, (w, h)).convert("RGB"))
    ds = reader.meta.level_downsamples[level]
    whole_tiles = 0
    for x, y in zip(xs.tolist(), ys.tolist(), strict=True):
        lx, ly = l0_to_level(x, ds), l0_to_level(y, ds)
        np.testing.assert_array_equal(
            reader.read_region(x, y, level, tile, tile), whole[ly : ly + tile, lx : lx + tile]
        )
        whole_tiles += reader._whole_tile(level, lx, ly, tile, tile) is not None
    if name.endswith(".svs"):  # the grid is aligned to its 256 px storage tiles
        assert plan.aligned and whole_tiles == len(xs)
    reader.close()
