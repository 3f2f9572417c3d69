"""The third-party slides: each opens with the backend and metadata the README documents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openslide
import pytest

from wsi_loader.errors import SlideOpenError, TileReadError
from wsi_loader.slides import open_slide

pytestmark = pytest.mark.testdata

OPENS = {
    # file: (backend, vendor, level count, mpp, mpp source)
    # tiled TIFF-family files go to the raw path ("tiff"); the rest to OpenSlide
    "small.svs": ("tiff", "aperio", 1, 0.499, "vendor"),
    "CMU-1-Small-Region.svs": ("tiff", "aperio", 1, 0.499, "vendor"),
    "tcga-cr-7395-01a-01-ts1.svs": ("tiff", "aperio", 2, None, "missing"),
    "boxes.tiff": ("tiff", "generic-tiff", 4, 352.7777798337701, "tiff-resolution"),
    "boxes_noicc.tiff": ("tiff", "generic-tiff", 4, 352.85814906304194, "tiff-resolution"),
    "test3-DAPI-2-(387).ndpi": ("openslide", "hamamatsu", 7, 0.2281750559028887, "vendor"),
    "yb10kx5k.zstd.tiff": ("tiff", "generic-tiff", 5, 352.858149123434, "tiff-resolution"),
    "small_la.tiff": ("openslide", "generic-tiff", 1, 1000.0, "tiff-resolution"),
    "dicom-boxes/boxes_0.dcm": ("openslide", "dicom", 1, 0.499, "vendor"),
    "kidney-48-5.tif": ("tiff", "tiff-uniform", 1, None, "missing"),
    "small_vectra.qptiff": ("tiff", "tiff-qpi", 1, 0.49653463077185084, "tiff-resolution"),
}

REJECTS = {
    "broken.svs": "Unsupported or missing image file",
    "unopenable.tiff": "Unsupported TIFF compression: 52479",
    "dicom-no-imagetype/small_dicom.dcm": "Couldn't get image flavor",
}


@pytest.mark.parametrize("name", sorted(OPENS))
def test_opens_with_documented_metadata(testdata: Path, name: str) -> None:
    backend, vendor, levels, mpp, source = OPENS[name]
    reader = open_slide(str(testdata / name))
    try:
        meta = reader.meta
        assert (meta.backend, meta.vendor, meta.level_count) == (backend, vendor, levels)
        assert meta.mpp == (pytest.approx(mpp) if mpp else None)
        assert meta.mpp_source == source
        w, h = meta.dimensions
        pixels = reader.read_region(0, 0, 0, min(w, 64), min(h, 64))
        assert pixels.dtype == np.uint8 and pixels.shape == (min(h, 64), min(w, 64), 3)
    finally:
        reader.close()


@pytest.mark.parametrize(
    "name", sorted(n for n, v in OPENS.items() if v[0] == "tiff" and n.endswith((".svs", ".tiff")))
)
def test_raw_path_metadata_equals_openslide(testdata: Path, name: str) -> None:
    raw = open_slide(str(testdata / name), "tiff")
    ref = open_slide(str(testdata / name), "openslide")
    for field in (
        "vendor",
        "level_dimensions",
        "level_downsamples",
        "mpp",
        "mpp_source",
        "objective_power",
        "tile_sizes",
    ):
        assert getattr(raw.meta, field) == getattr(ref.meta, field), field
    raw.close()
    ref.close()


@pytest.mark.parametrize("name", sorted(REJECTS))
def test_rejected_with_reason(testdata: Path, name: str) -> None:
    with pytest.raises(SlideOpenError, match=REJECTS[name]):
        open_slide(str(testdata / name))


def test_ndpi_and_dicom_match_plain_openslide(testdata: Path) -> None:
    for name in ["test3-DAPI-2-(387).ndpi", "dicom-boxes/boxes_0.dcm"]:
        reader = open_slide(str(testdata / name))
        ref = openslide.OpenSlide(str(testdata / name))
        expected = np.asarray(ref.read_region((0, 0), 0, (16, 16)))[..., :3]
        np.testing.assert_array_equal(reader.read_region(0, 0, 0, 16, 16), expected)
        reader.close()
        ref.close()


@pytest.mark.parametrize(
    "name",
    ["CMU-1-Small-Region.svs", "tcga-cr-7395-01a-01-ts1.svs", "boxes.tiff", "yb10kx5k.zstd.tiff"],
)
def test_tiff_backend_matches_openslide_at_level0(testdata: Path, name: str) -> None:
    """JPEG, JPEG 2000, deflate and ZSTD tiles decode to OpenSlide's pixels exactly."""
    a = open_slide(str(testdata / name), "openslide")
    b = open_slide(str(testdata / name), "tiff")
    for x, y in [(0, 0), (130, 70), (200, 190)]:
        np.testing.assert_array_equal(
            a.read_region(x, y, 0, 50, 60), b.read_region(x, y, 0, 50, 60)
        )
    a.close()
    b.close()


def test_unreadable_svs_latches_in_openslide(testdata: Path) -> None:
    reader = open_slide(str(testdata / "unreadable.svs"), "openslide")
    with pytest.raises(TileReadError, match="Bogus marker length"):
        reader.read_region(0, 0, 0, 16, 16)
    assert reader.broken is True
    reader.close()


def _bilinear(stored: np.ndarray, x: float, y: float, size: int) -> np.ndarray:
    """``stored`` sampled at (x + i, y + j) for a size x size window, bilinearly."""
    xs, ys = x + np.arange(size), y + np.arange(size)
    x0, y0 = np.floor(xs).astype(int), np.floor(ys).astype(int)
    ax, ay = (xs - x0)[None, :, None], (ys - y0)[:, None, None]
    pixels = stored.astype(np.float64)
    top = pixels[y0][:, x0] * (1 - ax) + pixels[y0][:, x0 + 1] * ax
    bottom = pixels[y0 + 1][:, x0] * (1 - ax) + pixels[y0 + 1][:, x0 + 1] * ax
    resampled: np.ndarray = top * (1 - ay) + bottom * ay
    return resampled


def test_a_level_at_a_non_integer_downsample_reads_the_stored_pixels(
    testdata: Path, tmp_path: Path
) -> None:
    """The TCGA JPEG 2000 slide's level 1 is at downsample 2.0005. Our level-1 tiles are the
    pixels stored there, on the level's own grid. OpenSlide's read_region maps level-0 x to
    x / 2.0005, a fraction of a pixel off that grid, and interpolates: its tiles are the
    stored pixels resampled bilinearly (within rounding), equal to ours only where x / 2.0005
    is whole, as at (0, 0). So the raw path is the reference at such levels
    (docs/concepts/pixels.md)."""
    import tifffile

    from wsi_loader import TileDataset, build_index
    from wsi_loader.slides._base import l0_to_level

    path = testdata / "tcga-cr-7395-01a-01-ts1.svs"
    with tifffile.TiffFile(path) as tif:
        stored = [page for page in tif.pages if page.is_tiled][1].asarray()
    index = build_index([path], tmp_path / "idx", level=1, tile_size=256, min_tissue=0.0)
    ds = TileDataset(index)
    with openslide.OpenSlide(str(path)) as slide:
        downsample = slide.level_downsamples[1]
        assert 2.0 < downsample < 2.001
        apart: list[int] = []  # OpenSlide's tiles vs ours, the largest difference
        for row in range(len(index)):
            x, y = (int(index.columns[c][row]) for c in ("l0_x", "l0_y"))
            lx, ly = l0_to_level(x, downsample), l0_to_level(y, downsample)
            ours = ds[row]["image"].permute(1, 2, 0).numpy()
            np.testing.assert_array_equal(ours, stored[ly : ly + 256, lx : lx + 256])
            theirs = np.asarray(slide.read_region((x, y), 1, (256, 256)))[..., :3]
            if (x, y) == (0, 0):
                np.testing.assert_array_equal(theirs, ours)  # on the grid: the same
                continue
            inside = lx + 257 < stored.shape[1] and ly + 257 < stored.shape[0]
            if inside:  # OpenSlide's: the stored pixels at x / downsample, interpolated
                resampled = _bilinear(stored, x / downsample, y / downsample, 256)
                assert np.abs(resampled - theirs).max() <= 3
                apart.append(int(np.abs(theirs.astype(int) - ours).max()))
        assert len(apart) >= 20 and np.mean(apart) > 15  # and so not ours
