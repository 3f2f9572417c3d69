"""What OpenSlide returns at a level whose downsample is not a whole number, against ours.

    .venv/bin/python benchmarks/pixels_at_fractional_downsamples.py [SLIDE] [--level 1]

Default slide: the TCGA JPEG 2000 scan of the test data (level 1 at downsample 2.0005). For
every 256 px tile of the level's own grid (level-0 x = round(level x * downsample), as the
index lays it) it prints how far OpenSlide's ``read_region`` is from ours (the largest
difference per tile, its mean and maximum), how far OpenSlide's is from the stored pixels
resampled bilinearly at x / downsample (what OpenSlide does), and the sharpness of both
(variance of the Laplacian; resampling blurs). Not a speed benchmark: the docs' numbers on
pixels at such levels come from here.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import openslide
import tifffile

from wsi_loader.slides import open_slide
from wsi_loader.slides._base import l0_to_level, level_to_l0

TILE = 256


def bilinear(stored: np.ndarray, x: float, y: float, size: int) -> np.ndarray:
    """``stored`` sampled at (x + i, y + j), bilinearly (edges clamped)."""
    xs, ys = x + np.arange(size), y + np.arange(size)
    x0, y0 = np.floor(xs).astype(int), np.floor(ys).astype(int)
    ax, ay = (xs - x0)[None, :, None], (ys - y0)[:, None, None]
    x1, y1 = np.minimum(x0 + 1, stored.shape[1] - 1), np.minimum(y0 + 1, stored.shape[0] - 1)
    pixels = stored.astype(np.float64)
    top = pixels[y0][:, x0] * (1 - ax) + pixels[y0][:, x1] * ax
    bottom = pixels[y1][:, x0] * (1 - ax) + pixels[y1][:, x1] * ax
    result: np.ndarray = top * (1 - ay) + bottom * ay
    return result


def sharpness(tile: np.ndarray) -> float:
    grey = tile.astype(np.float64).mean(axis=-1)
    laplacian = (
        4 * grey[1:-1, 1:-1] - grey[:-2, 1:-1] - grey[2:, 1:-1] - grey[1:-1, :-2] - grey[1:-1, 2:]
    )
    return float(laplacian.var())


def main() -> None:
    data = Path(os.environ.get("WSI_LOADER_TEST_DATA", "../shared/testdata"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("slide", nargs="?", default=str(data / "tcga-cr-7395-01a-01-ts1.svs"))
    parser.add_argument("--level", type=int, default=1)
    args = parser.parse_args()
    with tifffile.TiffFile(args.slide) as tif:
        stored = [page for page in tif.pages if page.is_tiled][args.level].asarray()
    ours_reader = open_slide(args.slide)
    apart, resampled_apart, sharp, stored_ones = [], [], [], 0
    with openslide.OpenSlide(args.slide) as slide:
        downsample = slide.level_downsamples[args.level]
        height, width = stored.shape[:2]
        for l_y in range(0, height - TILE, TILE):
            for l_x in range(0, width - TILE, TILE):
                x, y = level_to_l0(l_x, downsample), level_to_l0(l_y, downsample)
                assert (l0_to_level(x, downsample), l0_to_level(y, downsample)) == (l_x, l_y)
                ours = ours_reader.read_region(x, y, args.level, TILE, TILE)
                theirs = np.asarray(slide.read_region((x, y), args.level, (TILE, TILE)))[..., :3]
                stored_ones += int(np.array_equal(ours, stored[l_y : l_y + TILE, l_x : l_x + TILE]))
                apart.append(int(np.abs(theirs.astype(int) - ours).max()))
                resampled = bilinear(stored, x / downsample, y / downsample, TILE)
                resampled_apart.append(float(np.abs(resampled - theirs)[1:-1, 1:-1].max()))
                sharp.append(sharpness(ours) / max(sharpness(theirs), 1e-9))
    ours_reader.close()
    print(f"{args.slide}: level {args.level}, downsample {downsample}, {len(apart)} tiles")
    print(f"ours equal to the stored pixels: {stored_ones} of {len(apart)} tiles")
    print(
        "ours vs OpenSlide, largest difference per tile: "
        f"mean {np.mean(apart):.1f}, max {max(apart)}"
    )
    print(
        "OpenSlide vs the stored pixels resampled bilinearly at x / downsample: largest "
        f"difference {max(resampled_apart):.2f} (rounding)"
    )
    print(f"sharpness (Laplacian variance) ours / OpenSlide: mean {np.mean(sharp):.2f}x")


if __name__ == "__main__":
    main()
