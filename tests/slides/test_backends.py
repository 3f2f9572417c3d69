"""One contract every slide backend must pass, plus backend-specific behaviour."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openslide
import pytest

from tests.conftest import SlideFactory
from wsi_loader.errors import SlideNotFoundError, SlideOpenError, TileReadError
from wsi_loader.slides import open_slide
from wsi_loader.slides._base import SlideReader, resize, rgba_to_rgb
from wsi_loader.slides._tiff import TiffReader
from wsi_loader.slides._tiff_decode import to_rgb

BACKENDS = ["openslide", "tiff"]


@pytest.fixture(params=["svs", "tiff"])
def slide_path(request: pytest.FixtureRequest, make_slide: SlideFactory) -> Path:
    return make_slide(request.param, width=2100, height=1700, seed=3, mpp=0.25)


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_readers_are_context_managers_and_refuse_reads_once_closed(
    slide_path: Path, backend: str
) -> None:
    # `with open_slide(p) as slide:` as with openslide.OpenSlide; a read after close is the
    # caller's bug (ValueError, as for a closed file), never a bad tile to quarantine
    with open_slide(str(slide_path), backend) as reader:
        assert reader.read_region(256, 256, 0, 16, 16).shape == (16, 16, 3)
    assert reader.closed
    with pytest.raises(ValueError, match=f"read of a closed slide: {slide_path}") as info:
        reader.read_region(256, 256, 0, 16, 16)
    assert not isinstance(info.value, TileReadError)
    reader.close()  # closing twice is harmless


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_metadata(slide_path: Path, backend: str) -> None:
    reader = open_slide(str(slide_path), backend)
    try:
        assert isinstance(reader, SlideReader)
        meta = reader.meta
        assert meta.dimensions == (2100, 1700)
        assert meta.level_downsamples[:2] == (1.0, 4.0)
        assert meta.mpp == pytest.approx(0.25)
        assert meta.mpp_source in {"vendor", "tiff-resolution"}
        assert meta.tile_sizes[0] == (256, 256)
    finally:
        reader.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "window",
    [
        (0, 0, 0, 256, 256),
        (300, 257, 0, 300, 200),
        (2000, 1600, 0, 256, 256),
        (400, 400, 1, 64, 80),
    ],
)
def test_contract_pixels_match_openslide(
    slide_path: Path, backend: str, window: tuple[int, int, int, int, int]
) -> None:
    """Every backend returns what OpenSlide returns, including past the right/bottom edge."""
    reference = openslide.OpenSlide(str(slide_path))
    expected = rgba_to_rgb(np.asarray(reference.read_region(window[:2], window[2], window[3:])))
    reader = open_slide(str(slide_path), backend)
    got = reader.read_region(*window)
    assert got.shape == (window[4], window[3], 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, expected)
    reader.close()
    reference.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_corrupt_tile_raises_structured_error(
    make_slide: SlideFactory, backend: str
) -> None:
    path = make_slide("svs", corrupt=[(1, 1)], width=1024, height=1024, seed=4)
    reader = open_slide(str(path), backend)
    with pytest.raises(TileReadError) as info:
        reader.read_region(256, 256, 0, 256, 256)
    err = info.value
    assert (err.path, err.l0_x, err.l0_y, err.level) == (str(path), 256, 256, 0)
    assert err.cause and "marker" in err.cause.lower()
    reader.close()


def test_openslide_errors_latch_and_mark_reader_broken(make_slide: SlideFactory) -> None:
    path = make_slide("svs", corrupt=[(1, 1)], width=1024, height=1024, seed=4)
    reader = open_slide(str(path), "openslide")
    reader.read_region(0, 0, 0, 256, 256)
    with pytest.raises(TileReadError):
        reader.read_region(256, 256, 0, 256, 256)
    assert reader.broken is True
    with pytest.raises(TileReadError):  # a good tile on the same handle fails too: latched
        reader.read_region(0, 0, 0, 256, 256)
    reader.close()
    fresh = open_slide(str(path), "openslide")
    assert fresh.read_region(0, 0, 0, 256, 256).shape == (256, 256, 3)
    fresh.close()


def test_tiff_errors_do_not_latch(make_slide: SlideFactory) -> None:
    path = make_slide("svs", corrupt=[(1, 1)], width=1024, height=1024, seed=4)
    reader = open_slide(str(path), "tiff")
    with pytest.raises(TileReadError):
        reader.read_region(256, 256, 0, 256, 256)
    assert reader.read_region(0, 0, 0, 256, 256).shape == (256, 256, 3)
    reader.close()


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SlideNotFoundError) as info:
        open_slide(str(tmp_path / "nope.svs"))
    assert isinstance(info.value, FileNotFoundError)


def test_auto_falls_back_to_tifffile_only_for_unknown_formats(tmp_path: Path) -> None:
    text = tmp_path / "fake.svs"
    text.write_text("not a slide")
    with pytest.raises(SlideOpenError) as info:
        open_slide(str(text))
    assert "OpenSlide" in str(info.value) and "tifffile" in str(info.value)


def test_unknown_backend_name(small_svs: Path) -> None:
    with pytest.raises(ValueError, match="backend"):
        open_slide(str(small_svs), "cucim")


def test_to_rgb_conversions() -> None:
    grey = np.full((2, 2, 1), 10, np.uint8)
    assert to_rgb(grey).shape == (2, 2, 3)
    grey_alpha = np.zeros((1, 1, 2), np.uint8)  # fully transparent -> white
    assert to_rgb(grey_alpha).tolist() == [[[255, 255, 255]]]
    deep = np.full((1, 1, 3), 65535, np.uint16)
    assert to_rgb(deep).tolist() == [[[255, 255, 255]]]
    rgba = np.array([[[0, 0, 0, 0], [10, 20, 30, 255]]], np.uint8)
    assert rgba_to_rgb(rgba).tolist() == [[[255, 255, 255], [10, 20, 30]]]


def test_tiff_read_job_covers_exactly_one_uncached_jpeg_tile(make_slide: SlideFactory) -> None:
    path = make_slide("svs", corrupt=[(1, 1)], width=1024, height=1024, seed=4)
    reader = open_slide(str(path), "tiff")
    dest = np.zeros((256, 256, 3), dtype=np.uint8)
    assert reader.read_job(dest, 128, 0, 0, 256, 256) is None  # spans two storage tiles
    small = np.zeros((128, 128, 3), dtype=np.uint8)
    assert reader.read_job(small, 256, 0, 0, 256, 256) is None  # needs resampling
    job = reader.read_job(dest, 256, 0, 0, 256, 256)
    assert job is not None and not dest.any()  # nothing decoded until the job runs
    job()
    np.testing.assert_array_equal(dest, reader.read_region(256, 0, 0, 256, 256))
    corrupt = reader.read_job(dest, 256, 256, 0, 256, 256)
    assert corrupt is not None
    with pytest.raises(TileReadError) as info:
        corrupt()
    assert (info.value.l0_x, info.value.l0_y) == (256, 256)
    reader.close()


def test_tiff_segment_jobs_fill_the_cache_a_read_then_uses(make_slide: SlideFactory) -> None:
    path = make_slide("svs", width=1024, height=1024, seed=4)
    reader = open_slide(str(path), "tiff")
    assert isinstance(reader, TiffReader)
    jobs = reader.segment_jobs(128, 128, 0, 256, 256, 256, 256)  # across four storage tiles
    assert [job.key[2] for job in jobs] == [0, 1, 4, 5]
    for job in jobs:
        reader.keep(job.key, job.decode())
    assert reader.segment_jobs(128, 128, 0, 256, 256, 256, 256) == []  # all cached now
    scaled = reader.segment_jobs(0, 0, 0, 512, 512, 256, 256)  # DCT scale 2
    assert [(job.key[3], job.nbytes) for job in scaled] == [(2, 128 * 128 * 3)] * 4
    reader.close()


def test_openslide_read_job_resizes_and_is_refused_once_broken(make_slide: SlideFactory) -> None:
    path = make_slide("svs", corrupt=[(1, 1)], width=1024, height=1024, seed=4)
    reader = open_slide(str(path), "openslide")
    dest = np.zeros((128, 128, 3), dtype=np.uint8)
    job = reader.read_job(dest, 0, 0, 0, 256, 256)
    assert job is not None
    job()
    np.testing.assert_array_equal(dest, resize(reader.read_region(0, 0, 0, 256, 256), 128, 128))
    failing = reader.read_job(dest, 256, 256, 0, 256, 256)
    assert failing is not None
    with pytest.raises(TileReadError):
        failing()
    assert reader.broken and reader.read_job(dest, 0, 0, 0, 256, 256) is None
    reader.close()


def _tiled_tiff(path: Path, x_res: float, y_res: float) -> Path:
    """A one-level 512 x 512 tiled TIFF with the given pixels per centimetre."""
    import tifffile

    pixels = np.full((512, 512, 3), 200, np.uint8)
    tifffile.imwrite(
        path,
        pixels,
        tile=(256, 256),
        photometric="rgb",
        compression="jpeg",
        resolution=(x_res, y_res),
        resolutionunit="CENTIMETER",
    )
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_pixels_that_are_not_square_are_said(tmp_path: Path, backend: str) -> None:
    # 0.25 um across, 0.30 um down: tiles laid out by the x MPP are 20% taller in microns
    path = _tiled_tiff(tmp_path / "wide.tiff", 40_000, 100_000 / 3)
    reader = open_slide(str(path), backend)
    try:
        assert reader.meta.mpp == pytest.approx(0.25)
        assert reader.meta.note is not None
        assert "pixels are not square" in reader.meta.note
        assert "0.25 um across, 0.3 um down" in reader.meta.note
    finally:
        reader.close()
    # a difference of rounding (0.25 against 0.2502) is not worth a word
    path = _tiled_tiff(tmp_path / "square.tiff", 40_000, 39_968)
    reader = open_slide(str(path), backend)
    try:
        assert reader.meta.note is None
    finally:
        reader.close()
