from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

from tests.conftest import SlideFactory
from wsi_loader.index._tissue import (
    otsu_threshold,
    pixel_rule,
    read_mask_image,
    tile_fractions,
    tissue_mask,
)
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
    """The mask as first written, with scipy's morphology: the reference the fast one keeps.
    The stained pixels: Otsu on saturation, and the pale pixels 8-connected to them."""
    high = rgb.max(axis=-1).astype(np.float32)
    low = rgb.min(axis=-1).astype(np.float32)
    sat = np.where(high > 0, (high - low) / np.maximum(high, 1.0), 0.0).astype(np.float32)
    rule = pixel_rule(rgb, "brightfield")
    assert rule.threshold == max(otsu_threshold(sat), 0.05) and rule.pale is not None
    labels, _ = ndimage.label(sat > rule.pale, np.ones((3, 3), dtype=bool))
    saturated = sat > rule.threshold
    seeded = np.unique(labels[saturated])
    mask = saturated | np.isin(labels, seeded[seeded > 0])
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


def _single_level_jpeg_tiff(path: Path, width: int, height: int) -> Path:
    """A tiled JPEG TIFF with no pyramid (as some converters write), a pink blob on glass."""
    import tifffile

    image = np.full((height, width, 3), 242, np.uint8)
    image[height // 4 : height // 2, width // 4 : width * 3 // 4] = (220, 150, 190)
    tifffile.imwrite(
        path, image, tile=(256, 256), compression="jpeg", photometric="rgb", metadata=None
    )
    return path


def _block_means(full: np.ndarray, factor: int) -> np.ndarray:
    """The image averaged over factor x factor blocks, partial edge blocks padded with glass."""
    h, w = full.shape[:2]
    oh, ow = -(-h // factor), -(-w // factor)
    padded = np.full((oh * factor, ow * factor, 3), 255.0)
    padded[:h, :w] = full
    means: np.ndarray = padded.reshape(oh, factor, ow, factor, 3).mean(axis=(1, 3))
    return means


@pytest.mark.parametrize(("max_size", "factor"), [(256, 16), (410, 10)])
def test_a_single_level_slide_is_not_decoded_at_full_resolution_for_its_mask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_size: int, factor: int
) -> None:
    """A slide without a pyramid has only level 0 to find tissue on: its JPEG tiles are
    decoded shrunk (libjpeg's DCT scaling at 1/8), not at full size and then averaged; only
    the last few pixels of a side that is not a whole number of mask pixels are not."""
    from wsi_loader.slides._tiff_decode import Level

    path = _single_level_jpeg_tiff(tmp_path / "flat scan.v2.tif", 4096, 3072)
    scales: list[int] = []
    decode = Level.decode_jpeg

    def spy(level: object, data: bytes, out: object = None, scale: int = 1) -> np.ndarray:
        scales.append(scale)
        return decode(level, data, out, scale)  # type: ignore[arg-type]

    monkeypatch.setattr(Level, "decode_jpeg", spy)
    with open_slide(str(path), "tiff") as slide:
        assert slide.meta.level_count == 1
        image, level = read_mask_image(slide, max_size=max_size)
    assert level == 0 and image.shape == (-(-3072 // factor), -(-4096 // factor), 3)
    full_size = [s for s in scales if s == 1]
    assert scales.count(8) == 12 * 16 and len(full_size) <= 12 + 16  # the last column and row
    monkeypatch.setattr(Level, "decode_jpeg", decode)
    with open_slide(str(path), "tiff") as slide:
        full = slide.read_region(0, 0, 0, 4096, 3072)
    expected = _block_means(full, factor)  # the same picture as a full decode averaged down
    assert np.abs(image - expected).max() <= 3
    assert (tissue_mask(image) == tissue_mask(expected.round().astype(np.uint8))).mean() > 0.99


def test_a_mask_image_with_partial_edge_blocks_is_padded_with_glass(tmp_path: Path) -> None:
    path = _single_level_jpeg_tiff(tmp_path / "odd.tif", 1000, 700)
    with open_slide(str(path), "tiff") as slide:
        image, _ = read_mask_image(slide, max_size=64)  # factor 16: edges 8 and 12 px wide
        full = slide.read_region(0, 0, 0, 1000, 700)
    assert image.shape == (44, 63, 3)
    assert np.abs(image - _block_means(full, 16)).max() <= 3


def test_holes_larger_than_a_few_cells_are_glass() -> None:
    """A lumen in tissue is glass (as CLAM cuts holes out of its contours); a hole of a few
    pixels (a gap between cells) is tissue."""
    image = np.full((200, 300, 3), 242, np.uint8)
    image[40:160, 60:260] = (220, 150, 190)
    image[70:130, 100:160] = 242  # a lumen: 60 x 60 px
    image[100:104, 200:204] = 242  # a gap: 4 x 4 px (closed by the morphology anyway)
    image[60:66, 220:226] = 242  # 6 x 6 px
    mask = tissue_mask(image, max_hole=64)
    assert not mask[75:125, 105:155].any()
    assert mask[60:66, 220:226].all() and mask[100:104, 200:204].all()
    assert tissue_mask(image)[75:125, 105:155].all()  # None: every hole filled


def test_no_tile_is_mostly_tissue_and_mostly_glass(testdata: Path, tmp_path: Path) -> None:
    """The tissue column and qc_background count the same pixels as tissue: a tile's shares
    add up to at most 1, so none is at least half tissue and at least half glass (lumens were
    tissue for the first and glass for the second: 11 such tiles on these two slides)."""
    from wsi_loader.index import build_index

    slides = ["CMU-1-Small-Region.svs", "tcga-cr-7395-01a-01-ts1.svs", "test3-DAPI-2-(387).ndpi"]
    index = build_index([testdata / s for s in slides], tmp_path / "idx", tile_size=224,
                        level=0)  # fmt: skip
    cols = index.columns
    assert len(cols["tissue"]) > 400
    assert (cols["tissue"] + cols["qc_background"] <= 1 + 1e-6).all()
    brightfield = np.isin(cols["slide_id"], [0, 1])
    both = (cols["tissue"] >= 0.5) & (cols["qc_background"] >= 0.5)
    assert not (both & brightfield).any()
    # a fluorescence slide's coarse mask splits a few tiles exactly in half, never more
    assert not ((cols["tissue"] > 0.5) & (cols["qc_background"] >= 0.5)).any()


# a dark haematoxylin, pale eosin staining (validate_qc.py's "another H&E, H x1.4, E x0.7"):
# its cellular cores are far more saturated than its stroma, and Otsu's one threshold on
# saturation fell between the two where the cores are a large share of the tissue (seed 2:
# the tissue column was 0.49 over tiles all of tissue)
PALE_EOSIN = {
    "width": 8000, "height": 4000, "seed": 2, "mpp": 0.5,
    "stain": ((0.65, 0.70, 0.29), (0.30, 0.80, 0.45)), "amounts": (1.4, 0.7),
}  # fmt: skip


def test_pale_eosin_stroma_is_tissue(make_slide: SlideFactory, tmp_path: Path) -> None:
    from wsi_loader.index import build_index
    from wsi_loader.synthetic import SlideSpec, tissue_of

    path = make_slide(**PALE_EOSIN)
    index = build_index([path], tmp_path / "idx", tile_size=256, mpp=0.5, min_tissue=0.0,
                        qc="none")  # fmt: skip
    cols = index.columns
    spec = SlideSpec(**PALE_EOSIN)  # type: ignore[arg-type]
    mask = tissue_of(spec)
    truth = np.array(
        [mask(float(x), float(y), 8.0, 32, 32).mean() for x, y in zip(cols["l0_x"], cols["l0_y"],
                                                                       strict=True)]
    )  # fmt: skip
    tissue = np.asarray(cols["tissue"])
    inside, glass = truth >= 0.99, truth == 0
    assert inside.sum() >= 50 and glass.sum() >= 50
    assert tissue[inside].mean() >= 0.95, tissue[inside].mean()
    assert (tissue[inside] >= 0.5).all()
    assert tissue[glass].max() <= 0.05  # ...and glass is not
