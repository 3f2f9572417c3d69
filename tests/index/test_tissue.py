from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

from tests.conftest import SlideFactory
from wsi_loader.index.tissue import otsu_threshold, read_mask_image, tile_fractions, tissue_mask
from wsi_loader.slides import open_slide


def test_otsu_separates_two_populations() -> None:
    values = np.concatenate([np.full(500, 0.1), np.full(500, 0.7)])
    assert 0.1 < otsu_threshold(values) <= 0.7


def test_blank_glass_has_no_tissue() -> None:
    rng = np.random.default_rng(0)
    glass = (240 + rng.integers(-3, 3, (200, 300, 3))).astype(np.uint8)
    assert not tissue_mask(glass).any()


def test_pink_region_is_found() -> None:
    image = np.full((200, 300, 3), 242, np.uint8)
    image[50:150, 100:250] = (220, 150, 190)
    mask = tissue_mask(image)
    assert mask[60:140, 110:240].all() and not mask[:40].any()


def _scipy_tissue_mask(rgb: np.ndarray, radius: int) -> np.ndarray:
    """The mask as first written, with scipy's morphology: the reference the fast one keeps."""
    high = rgb.max(axis=-1).astype(np.float32)
    low = rgb.min(axis=-1).astype(np.float32)
    sat = np.where(high > 0, (high - low) / np.maximum(high, 1.0), 0.0).astype(np.float32)
    mask = sat > max(otsu_threshold(sat), 0.05)
    cross = ndimage.generate_binary_structure(2, 1)
    mask = ndimage.binary_closing(mask, cross, iterations=radius, border_value=0)
    mask = ndimage.binary_opening(mask, cross, iterations=radius)
    return np.asarray(ndimage.binary_fill_holes(mask), dtype=bool)


@pytest.mark.parametrize(
    "shape", [(1, 1), (1, 7), (9, 1), (2, 3), (64, 48), (300, 200), (257, 1100), (1200, 700)]
)
def test_mask_equals_scipy_morphology_pixel_for_pixel(shape: tuple[int, int]) -> None:
    # blobs of stain with holes, specks and thin lines on glass, touching the borders: every
    # case where closing, opening and hole filling differ from a plain threshold
    rng = np.random.default_rng(sum(shape))
    h, w = shape
    image = np.full((h, w, 3), 240, np.uint8) - rng.integers(0, 6, (h, w, 3)).astype(np.uint8)
    yy, xx = np.mgrid[:h, :w]
    for _ in range(12):
        cy, cx, r = (
            rng.uniform(-0.1, 1.1) * h,
            rng.uniform(-0.1, 1.1) * w,
            rng.uniform(1, 2 + 0.3 * max(h, w)),
        )
        ring = (np.hypot(yy - cy, xx - cx) < r) & (
            np.hypot(yy - cy, xx - cx) > r * rng.uniform(0, 0.6)
        )
        image[ring] = rng.integers(120, 230, 3)
    specks = rng.random((h, w)) < 0.02
    image[specks] = (200, 90, 160)
    image[rng.random((h, w)) < 0.01] = 0  # black pixels: saturation's high == 0 branch
    image[:, rng.integers(0, w)] = (180, 60, 120)  # a line one pixel wide
    radius = max(1, round(max(shape) / 512))
    assert np.array_equal(tissue_mask(image), _scipy_tissue_mask(image, radius))


def test_tile_fractions_match_brute_force() -> None:
    rng = np.random.default_rng(1)
    mask = rng.random((50, 80)) > 0.5
    l0_size = (800, 500)  # mask is 1/10 scale
    xs = np.array([0, 100, 390, 700], dtype=np.int64)
    ys = np.array([0, 200, 90, 400], dtype=np.int64)
    got = tile_fractions(mask, l0_size, xs, ys, 100.0)
    for x, y, g in zip(xs, ys, got, strict=True):
        assert g == pytest.approx(mask[y // 10 : y // 10 + 10, x // 10 : x // 10 + 10].mean())


class LevelSpy:
    """Wraps a reader and records which levels were read."""

    def __init__(self, path: Path) -> None:
        self.inner = open_slide(str(path))
        self.meta = self.inner.meta
        self.path = str(path)
        self.levels: list[int] = []

    def read_region(self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int) -> np.ndarray:
        self.levels.append(level)
        return self.inner.read_region(l0_x, l0_y, level, l_w, l_h)

    def close(self) -> None:
        self.inner.close()


def test_mask_comes_from_the_lowest_level_in_chunks(make_slide: SlideFactory) -> None:
    spy = LevelSpy(make_slide(width=12000, height=9000, seed=5))
    image, level = read_mask_image(spy, max_size=128)  # type: ignore[arg-type]
    assert level == spy.meta.level_count - 1 == 3
    assert set(spy.levels) == {3}
    assert max(image.shape[:2]) <= 128
    spy.close()
