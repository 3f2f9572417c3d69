"""Deep Zoom tiles made by the viewer's tile maker, against OpenSlide's own Deep Zoom generator
(`openslide.deepzoom.DeepZoomGenerator`, the reference of the deepzoom example) and the bytes
stored in the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openslide
import pytest
import simplejpeg
import tifffile
from openslide.deepzoom import DeepZoomGenerator
from PIL import Image

from tests.conftest import SlideFactory
from wsi_loader.synthetic import SlideSpec, write_tiff
from wsi_loader.view.browser._geometry import DeepZoom, Source, deep_zoom_sizes
from wsi_loader.view.browser._tiles import (
    ERROR_GREY,
    ERROR_MARK,
    SlideRef,
    TileMaker,
    TileOptions,
    halve,
)

SIZE = {"width": 5000, "height": 4000, "seed": 5}
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # JPEG's Y


def ref_of(path: Path, slide_id: int = 0, version: str = "v1") -> SlideRef:
    with openslide.OpenSlide(str(path)) as slide:
        width, height = slide.dimensions
    return SlideRef(slide_id, str(path), version, width, height)


def decode(data: bytes) -> np.ndarray:
    return simplejpeg.decode_jpeg(data, colorspace="RGB")


@pytest.fixture
def maker() -> TileMaker:
    made = TileMaker(TileOptions(threads=1))
    yield made
    made.close()


ADOBE_RGB = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00"  # APP14, transform 0: RGB


def stored_jpeg(path: Path, page: int, index: int, rgb: bool = False) -> bytes:
    """Tile ``index`` of ``page`` as a complete JPEG: the file's shared tables (without their
    end marker) and the tile's stream (without its start marker), read with tifffile; with
    ``rgb``, the Adobe marker that says the components are RGB after the start marker."""
    with tifffile.TiffFile(str(path)) as tif:
        p = tif.pages[page]
        tif.filehandle.seek(p.dataoffsets[index])
        body = tif.filehandle.read(p.databytecounts[index])
        tables = p.jpegtables[:-2]
        if rgb:
            tables = tables[:2] + ADOBE_RGB + tables[2:]
        return tables + body[2:]


def test_levels_and_tiles_are_openslides_deep_zoom(make_slide: SlideFactory) -> None:
    path = make_slide(**SIZE)
    with openslide.OpenSlide(str(path)) as slide:
        reference = DeepZoomGenerator(slide, tile_size=256, overlap=0, limit_bounds=False)
        layout = DeepZoom(*slide.dimensions, 256, slide.level_dimensions, slide.level_downsamples)
        assert layout.sizes == list(reference.level_dimensions)
        assert [layout.tiles(z) for z in range(layout.levels)] == list(reference.level_tiles)
    assert deep_zoom_sizes(1, 1) == [(1, 1)]
    assert deep_zoom_sizes(5, 3) == [(1, 1), (2, 1), (3, 2), (5, 3)]


def test_bounds_are_checked() -> None:
    layout = DeepZoom(1000, 600, 256, ((1000, 600),), (1.0,))
    top = layout.levels - 1
    assert layout.has_tile(top, 3, 2)
    for z, col, row in [(top, 4, 0), (top, 0, 3), (top + 1, 0, 0), (-1, 0, 0), (0, 1, 0)]:
        assert not layout.has_tile(z, col, row)


def test_a_level_of_an_aperio_size_is_read_pixel_for_pixel() -> None:
    # Aperio levels are width // 4 wide, 4.0002x apart: tiles there must still be whole stored
    # tiles (not windows drifting by a pixel every 5,000)
    dims = ((40000, 30000), (10000, 7500), (2500, 1875))
    downsamples = (1.0, 4.0002, 16.001)
    layout = DeepZoom(40000, 30000, 256, dims, downsamples, ((256, 256),) * 3)
    z = layout.levels - 3  # downsample 4
    plan = layout.plan(z, 30, 20)
    assert (plan.source, plan.level, plan.l_w, plan.stored) == (Source.SLIDE, 1, 256, True)
    assert round(plan.l0_x / downsamples[1]) == 30 * 256  # exactly column 30 of level 1
    half = layout.plan(z + 1, 30, 20)  # downsample 2: level 0 shrunk by exactly 2
    assert (half.level, half.l_w, half.stored) == (0, 512, False)


def test_stored_tiles_pass_through_byte_for_byte(
    maker: TileMaker, make_slide: SlideFactory
) -> None:
    path = make_slide(**SIZE)
    ref = ref_of(path)
    layout, problem = maker.layout(ref)
    assert problem is None and layout.tile_size == 256
    top = layout.levels - 1
    with tifffile.TiffFile(str(path)) as tif:
        across = [-(-p.imagewidth // 256) for p in tif.pages if p.is_tiled]
    # level 0 is page 0; level 1 (downsample 4) is page 2, after the thumbnail
    for z, page, level_across in [(top, 0, across[0]), (top - 2, 2, across[1])]:
        for col, row in [(0, 0), (2, 1), (1, 2)]:
            tile = maker.tile(ref, z, col, row)
            assert tile.passed_through and tile.error is None
            assert tile.body == stored_jpeg(path, page, row * level_across + col)
    assert maker.passed_through == 6


def on_white(region: Image.Image) -> Image.Image:
    """An OpenSlide region composited onto white (outside the slide is transparent)."""
    white = Image.new("RGBA", region.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, region).convert("RGB")


def shrunk(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """``pixels`` averaged down to ``height`` x ``width`` (area means; PIL's box filter for a
    factor that is not whole)."""
    h, w = pixels.shape[:2]
    if h % height == 0 and w % width == 0:
        fy, fx = h // height, w // width
        return pixels.reshape(height, fy, width, fx, 3).mean(axis=(1, 3))
    picture = Image.fromarray(pixels.astype(np.uint8)).resize((width, height), Image.Resampling.BOX)
    return np.asarray(picture, dtype=np.float32)


def test_every_level_shows_the_window_it_should(maker: TileMaker, make_slide: SlideFactory) -> None:
    # each tile against OpenSlide's read of the slide level it is made from, averaged down:
    # close, and farther from it shifted by one pixel (a misplaced window would be closer)
    path = make_slide(**SIZE)
    ref = ref_of(path)
    layout, _ = maker.layout(ref)
    with openslide.OpenSlide(str(path)) as slide:
        for z in range(layout.levels):
            cols, rows = layout.tiles(z)
            for col, row in {(0, 0), (cols // 2, rows // 2), (cols - 1, rows - 1)}:
                plan = layout.plan(z, col, row)
                ours = decode(maker.tile(ref, z, col, row).body).astype(np.float32)
                assert ours.shape == (plan.z_h, plan.z_w, 3), (z, col, row)
                if plan.source is not Source.SLIDE:
                    continue  # the overview: see the test of a slide without a pyramid
                region = slide.read_region((plan.l0_x, plan.l0_y), plan.level, (plan.l_w, plan.l_h))
                window = np.asarray(on_white(region), dtype=np.float32)
                expected = shrunk(window, plan.z_h, plan.z_w)
                error = np.abs(ours - expected).mean()
                # libjpeg's DCT scaling is not an area mean: a few grey levels, more on tiny tiles
                tolerance = 1 if plan.stored else (8 if min(plan.z_w, plan.z_h) < 64 else 5)
                assert error < tolerance, (z, col, row, error)
                if min(plan.z_w, plan.z_h) >= 32:
                    shifted = np.abs(ours[1:, 1:] - expected[:-1, :-1]).mean()
                    assert error < shifted, (z, col, row, error, shifted)


def test_stored_levels_are_openslides_deep_zoom_tiles(
    maker: TileMaker, make_slide: SlideFactory
) -> None:
    # where both read a stored level as it is, our tiles are DeepZoomGenerator's (of the
    # deepzoom example), as the stored bytes are its pixels
    path = make_slide(**SIZE)
    ref = ref_of(path)
    layout, _ = maker.layout(ref)
    top = layout.levels - 1
    with openslide.OpenSlide(str(path)) as slide:
        reference = DeepZoomGenerator(slide, tile_size=256, overlap=0, limit_bounds=False)
        for z in (top, top - 2):
            ours = decode(maker.tile(ref, z, 2, 1).body).astype(np.int16)
            theirs = np.asarray(reference.get_tile(z, (2, 1)).convert("RGB"), np.int16)
            assert np.abs(ours - theirs).mean() < 1, z


def test_the_openslide_backend_gives_the_same_tiles(make_slide: SlideFactory) -> None:
    path = make_slide(**SIZE)
    ref = ref_of(path)
    raw = TileMaker(TileOptions(quality=95))
    universal = TileMaker(TileOptions(quality=95, backend="openslide"))
    try:
        layout, _ = raw.layout(ref)
        for z in (layout.levels - 1, layout.levels - 2, layout.levels - 4):
            a = decode(raw.tile(ref, z, 1, 1).body).astype(np.int16)
            b = decode(universal.tile(ref, z, 1, 1).body).astype(np.int16)
            assert np.abs(a - b).mean() < 4, z  # DCT scaling against bilinear
        assert universal.passed_through == 0  # OpenSlide hands out pixels, not stored bytes
    finally:
        raw.close()
        universal.close()


def test_a_slide_without_a_pyramid_is_shown_at_every_level(tmp_path: Path) -> None:
    # one level only: coarse tiles come from the overview image, the levels between from the
    # four finer tiles (`Source.CHILDREN`)
    pyramid = write_tiff(str(tmp_path / "pyramid.tiff"), SlideSpec(width=4096, height=3072))
    with tifffile.TiffFile(pyramid) as tif:
        full = tif.pages[0].asarray()
    flat = tmp_path / "flat.tiff"
    tifffile.imwrite(flat, full, tile=(256, 256), compression="jpeg", photometric="rgb")
    ref = SlideRef(0, str(flat), "v1", 4096, 3072)
    maker = TileMaker(TileOptions(threads=1), overview_size=128)
    try:
        layout, _ = maker.layout(ref)
        top = layout.levels - 1
        sources = {z: layout.plan(z, 0, 0).source for z in range(layout.levels)}
        assert sources[top - 3] is Source.SLIDE and sources[top - 4] is Source.CHILDREN
        assert sources[top - 5] is Source.OVERVIEW
        for z in (top - 3, top - 4, top - 5, 2):
            d = layout.downsample(z)
            cols, rows = layout.tiles(z)
            for col, row in {(0, 0), (cols - 1, rows - 1)}:
                ours = decode(maker.tile(ref, z, col, row).body).astype(np.float32)
                ours = ours.mean(axis=2)  # luma: 4:2:0 chroma smears colour on tiny tiles
                x0, y0 = col * 256 * d, row * 256 * d
                window = full[y0 : y0 + 256 * d, x0 : x0 + 256 * d].astype(np.float32)
                h, w = ours.shape[:2]
                window = np.pad(
                    window,
                    ((0, h * d - window.shape[0]), (0, w * d - window.shape[1]), (0, 0)),
                    mode="edge",
                )
                expected = window.reshape(h, d, w, d, 3).mean(axis=(1, 3, 4))
                # a few pixels of noisy texture averaged by other filters differ more
                assert np.abs(ours - expected).mean() < (8 if min(h, w) < 16 else 5), (z, col, row)
    finally:
        maker.close()


def test_an_unreadable_tile_is_grey_with_a_cross_and_counted(
    maker: TileMaker, make_slide: SlideFactory
) -> None:
    path = make_slide(width=2048, height=2048, seed=32, corrupt=[(3, 3)])
    ref = ref_of(path)
    layout, _ = maker.layout(ref)
    top = layout.levels - 1
    for attempt in (1, 2):  # never cached: asked again, read again
        tile = maker.tile(ref, top, 3, 3)
        assert tile.error is not None and "(768, 768), level 0 cannot be decoded" in tile.error
        pixels = decode(tile.body).astype(np.int16)
        grey = np.abs(pixels - ERROR_GREY).max(axis=2) < 12
        red = np.abs(pixels - np.array(ERROR_MARK)).max(axis=2) < 60
        assert grey.mean() > 0.8 and red.mean() > 0.02
        assert maker.faults(0).count == attempt
    assert maker.tile(ref, top, 2, 3).error is None  # its neighbours read
    assert maker.tile(ref, top - 1, 1, 1).error is not None  # a coarser tile made from it


def test_a_missing_slide_gives_grey_tiles_of_its_indexed_size(maker: TileMaker) -> None:
    ref = SlideRef(3, "/nonexistent/slide.svs", "missing", 1000, 700)
    layout, problem = maker.layout(ref)
    assert problem is not None and "does not exist" in problem
    assert layout.sizes[-1] == (1000, 700)
    tile = maker.tile(ref, layout.levels - 1, 3, 2)
    assert tile.error is not None
    assert decode(tile.body).shape == (700 - 512, 1000 - 768, 3)


def test_the_tile_cache_is_bounded_in_bytes(make_slide: SlideFactory) -> None:
    path = make_slide(**SIZE)
    ref = ref_of(path)
    maker = TileMaker(TileOptions(cache_mb=1, tile_size=300))
    try:
        layout, _ = maker.layout(ref)
        top = layout.levels - 1
        cols, rows = layout.tiles(top)
        made = sum(len(maker.tile(ref, top, c, r).body) for c in range(cols) for r in range(rows))
        assert made > 2 * 2**20  # more than the cache holds
        assert 0 < maker.tiles.nbytes <= 2**20
        assert maker.passed_through == 0  # 300 px tiles are not stored tiles
        assert decode(maker.tile(ref, top, 0, 0).body).shape == (300, 300, 3)
    finally:
        maker.close()


def test_a_replaced_file_never_shows_cached_tiles(
    maker: TileMaker, make_slide: SlideFactory, tmp_path: Path
) -> None:
    first, second = make_slide(**SIZE), make_slide(width=5000, height=4000, seed=6)
    slide = tmp_path / "slide.svs"
    slide.write_bytes(first.read_bytes())
    old = maker.tile(SlideRef(0, str(slide), "v1", 5000, 4000), 12, 1, 1).body
    slide.write_bytes(second.read_bytes())
    new = maker.tile(SlideRef(0, str(slide), "v2", 5000, 4000), 12, 1, 1).body
    assert new != old
    assert new == TileMaker().tile(SlideRef(0, str(second), "v", 5000, 4000), 12, 1, 1).body


def test_halve_averages_2x2_blocks() -> None:
    pixels = np.arange(5 * 3 * 3, dtype=np.uint8).reshape(5, 3, 3)
    out = halve(pixels)
    assert out.shape == (3, 2, 3)
    assert out[0, 0, 0] == round(pixels[0:2, 0:2, 0].mean())
    assert out[2, 1, 0] == pixels[4, 2, 0]  # an odd corner averaged with itself


@pytest.mark.testdata
def test_a_real_aperio_scan_passes_through_its_240_px_tiles(testdata: Path) -> None:
    path = testdata / "CMU-1-Small-Region.svs"
    ref = ref_of(path)
    maker = TileMaker()
    try:
        layout, _ = maker.layout(ref)
        assert layout.tile_size == 240  # its storage tiles
        top = layout.levels - 1
        across = -(-2220 // 240)
        tile = maker.tile(ref, top, 2, 3)
        assert tile.passed_through and tile.body == stored_jpeg(path, 0, 3 * across + 2, rgb=True)
        with openslide.OpenSlide(str(path)) as slide:
            expected = np.asarray(slide.read_region((480, 720), 0, (240, 240)).convert("RGB"))
        assert np.abs(decode(tile.body).astype(np.int16) - expected).mean() < 1
        edge = maker.tile(ref, top, across - 1, 0)  # 60 px wide: made, not passed through
        assert not edge.passed_through and decode(edge.body).shape == (240, 60, 3)
    finally:
        maker.close()


@pytest.mark.testdata
def test_a_real_ndpi_is_served_through_openslide(testdata: Path) -> None:
    path = testdata / "test3-DAPI-2-(387).ndpi"
    ref = ref_of(path)
    maker = TileMaker()
    try:
        layout, problem = maker.layout(ref)
        assert problem is None and layout.tile_size == 256  # its 3968 x 8 strips are not tiles
        with openslide.OpenSlide(str(path)) as slide:
            reference = DeepZoomGenerator(slide, tile_size=256, overlap=0, limit_bounds=False)
            for z in (layout.levels - 1, layout.levels - 3, layout.levels - 4):
                ours = decode(maker.tile(ref, z, 1, 1).body).astype(np.float32)
                theirs = np.asarray(reference.get_tile(z, (1, 1)).convert("RGB"), np.float32)
                # luma (Y): this DAPI channel is all blue, which 4:2:0 JPEG (as scanners store
                # and PIL writes) keeps at half resolution in its chroma
                assert np.abs((ours - theirs) @ LUMA).mean() < 2, z
    finally:
        maker.close()


def test_a_broken_stored_tile_greys_only_its_part_of_a_zoomed_out_tile(
    make_slide: SlideFactory,
) -> None:
    # 512 px Deep Zoom tiles at half resolution: tile (0, 0) shows level-0 (0..1024)^2 and the
    # broken 256 px storage tile (3, 3) in its bottom-right 128 px; the rest reads
    broken = make_slide(width=2048, height=2048, seed=32, corrupt=[(3, 3)])
    intact = make_slide(width=2048, height=2048, seed=32)
    maker = TileMaker(TileOptions(threads=1, tile_size=512))
    try:
        layout, _ = maker.layout(ref_of(broken))
        z = layout.levels - 2
        assert layout.plan(z, 0, 0).source is Source.SLIDE and layout.plan(z, 0, 0).l_w == 1024
        tile = maker.tile(ref_of(broken), z, 0, 0)
        good = decode(maker.tile(ref_of(intact, slide_id=1), z, 0, 0).body).astype(np.int16)
    finally:
        maker.close()
    assert tile.error is not None and "(768, 768)" in tile.error
    pixels = decode(tile.body).astype(np.int16)
    grey = np.abs(pixels - ERROR_GREY).max(axis=2) < 12
    failed = np.zeros(grey.shape, dtype=bool)
    failed[384:512, 384:512] = True
    assert grey[392:504, 392:504].mean() > 0.7  # the broken part is grey...
    outside = ~failed
    outside[376:, 376:] = False  # JPEG blocks straddling the edge
    assert np.abs(pixels - good).max(axis=2)[outside].mean() < 2.0  # ...the rest the slide's
