"""`TiffReader.ranges_of`, the look-ahead's plan of a batch's bytes: windows that are exactly
one storage tile are planned together with numpy, and the result must be `byte_ranges` of
every window, in order, whatever the mix (other levels, non-integer downsamples, windows off
the storage grid, at the level's edge, outside it, shrunk, segments already decoded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsi_loader.slides._base import level_to_l0
from wsi_loader.slides._tiff import TiffReader


def one_by_one(
    reader: TiffReader, windows: list[tuple[int, int, int, int, int]], out: int
) -> list[tuple[int, int]]:
    return [r for window in windows for r in reader.byte_ranges(window, out)]


@pytest.mark.testdata
@pytest.mark.parametrize(
    ("name", "tile"), [("tcga-cr-7395-01a-01-ts1.svs", 256), ("boxes.tiff", 64)]
)
def test_planned_together_as_one_by_one(testdata: Path, name: str, tile: int) -> None:
    reader = TiffReader(str(testdata / name))
    rng = np.random.default_rng(0)
    windows = []
    for level, ds in enumerate(reader.meta.level_downsamples):
        w, h = reader.meta.level_dimensions[level]
        for lx in range(0, w + tile, tile):  # on the grid, the last ones past the edge
            for ly in range(0, h, tile):
                x, y = level_to_l0(lx, ds), level_to_l0(ly, ds)
                windows.append((x, y, level, tile, tile))
                # level-0 points beside it: some round onto the grid point, some off it
                for d in (-3, -2, -1, 1, 2, 3):
                    windows += [(x + d, y, level, tile, tile), (x, y + d, level, tile, tile)]
        windows.append((level_to_l0(5, ds), 0, level, tile, tile))  # off the grid
        windows.append((-level_to_l0(tile, ds), 0, level, tile, tile))  # outside
        windows.append((0, -level_to_l0(tile, ds), level, tile, tile))
        windows.append((0, 0, level, tile // 2, tile // 2))  # smaller than a storage tile
    order = rng.permutation(len(windows))
    mixed = [windows[i] for i in order]
    assert reader.ranges_of(mixed, tile) == one_by_one(reader, mixed, tile)
    # shrunk reads (DCT-scaled or resampled) never take the whole-tile plan
    assert reader.ranges_of(mixed, tile // 2) == one_by_one(reader, mixed, tile // 2)
    # all on the grid: the numpy plan alone
    aligned = [window for window in windows if window[0] >= 0 and window[3] == tile]
    assert reader.ranges_of(aligned, tile) == one_by_one(reader, aligned, tile)
    assert reader.ranges_of([], tile) == []
    reader.close()


def test_segments_already_decoded_are_left_out(small_svs: Path) -> None:
    reader = TiffReader(str(small_svs))  # YCbCr JPEG tiles of 256 px: DCT-scalable
    assert reader._levels[0].dct_scalable
    windows = [(x, y, 0, 256, 256) for y in range(0, 1792, 256) for x in range(0, 2816, 256)]
    before = reader.ranges_of(windows, 256)
    assert len(before) == len(windows)
    reader.read_region(0, 0, 0, 300, 300)  # off one tile: four segments go to the cache
    after = reader.ranges_of(windows, 256)
    assert after == one_by_one(reader, windows, 256)
    assert len(after) == len(windows) - 4
    # a shrunk read decodes at another scale (libjpeg's DCT scaling): other cache entries
    assert reader.ranges_of(windows, 128) == one_by_one(reader, windows, 128) == before
    reader.close()
