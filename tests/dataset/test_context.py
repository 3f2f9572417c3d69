"""Context tiles: the level each scale is read from, the pixels (against OpenSlide), centring
at odd and even sizes and at the slide's edges, shared decodes, and failures."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import openslide
import pytest
from PIL import Image

from tests.conftest import SlideFactory
from wsi_loader.dataset import TileDataset
from wsi_loader.dataset._reading import TileReader
from wsi_loader.errors import ConfigError, TileReadError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.slides._base import rgba_to_rgb
from wsi_loader.slides._tiff_decode import Level

# a 40x scan: 0.25 um/px, levels of downsample exactly 1, 4, 16 (0.25, 1.0 and 4.0 um/px;
# non-integer downsamples are another matter: docs/concepts/pixels.md)
FINE = {"width": 3072, "height": 2048, "seed": 21, "mpp": 0.25}
# scale -> (level, window edge in level pixels): the coarsest level at least as fine
LEVELS = {
    (2.0, 224): (1, 448),  # level 1 (1.0 um/px) shrunk by 2, never level 0
    (1.0, 100): (1, 100),  # level 1 as stored
    (4.0, 64): (2, 64),  # level 2 as stored
    (0.5, 101): (0, 202),  # level 0 shrunk by 2, an odd size
    (1.3, 50): (1, 65),  # 30% beyond level 1: resampled (bilinear, pitch 1.3)
}
SCALES = list(LEVELS)


@pytest.fixture(scope="module")
def fine_index(tmp_path_factory: pytest.TempPathFactory, make_slide: SlideFactory) -> SlideIndex:
    slide = make_slide(**FINE)
    out = tmp_path_factory.mktemp("fine")
    return build_index([slide], out / "idx", tile_size=224, mpp=0.5, min_tissue=0.0)


def on_slide_box(l_x: int, l_y: int, read: int, size: int, width: int, height: int) -> tuple:
    """The box of pixels whose centres fall on the level, pixel by pixel (no formula)."""

    def axis(start: int, length: int) -> tuple[int, int]:
        inside = [i for i in range(size) if 0 <= start + (i + 0.5) * read / size < length]
        return (inside[0], inside[-1] + 1) if inside else (0, 0)

    (x0, x1), (y0, y1) = axis(l_x, width), axis(l_y, height)
    return (x0, y0, x1, y1)


def expected_window(
    slide: openslide.OpenSlide, l0_x: int, l0_y: int, main_read: int, scale: tuple[float, int]
) -> tuple[int, int, int, int]:
    """Level, level-pixel top-left and window edge of a scale, by the stated rule: the grid of
    the scale's pixels over its level, the block whose centre is nearest the main centre
    (main windows of these indexes are level-0 windows)."""
    level, read = LEVELS[scale] if scale in LEVELS else (0, scale[1])
    size = scale[1]
    ds = slide.level_downsamples[level]
    pitch = read / size

    def axis(l0: int) -> int:
        centre = (l0 + main_read / 2) / ds
        return round(math.floor(centre / pitch - size / 2 + 0.5 + 1e-9) * pitch)

    return level, axis(l0_x), axis(l0_y), read


def reference(
    slide: openslide.OpenSlide, level: int, l_x: int, l_y: int, read: int, size: int, fill: int
) -> np.ndarray:
    """OpenSlide's read_region of the window (composited onto white), resized with PIL's
    bilinear filter when the window is not the tile's size, off-slide pixels filled."""
    ds = slide.level_downsamples[level]
    rgba = np.asarray(slide.read_region((round(l_x * ds), round(l_y * ds)), level, (read, read)))
    pixels = rgba_to_rgb(rgba)
    if read != size:
        pixels = np.asarray(
            Image.fromarray(np.ascontiguousarray(pixels)).resize(
                (size, size), Image.Resampling.BILINEAR
            )
        )
    pixels = pixels.copy()
    width, height = slide.level_dimensions[level]
    x0, y0, x1, y1 = on_slide_box(l_x, l_y, read, size, width, height)
    outside = np.ones((size, size), dtype=bool)
    outside[y0:y1, x0:x1] = False
    pixels[outside] = fill
    return pixels


@pytest.mark.parametrize("backend", ["openslide", "auto"])
def test_each_scale_is_read_from_its_level_and_equals_openslide(
    fine_index: SlideIndex, backend: str
) -> None:
    """Every context tile is OpenSlide's read_region of the stated window at the chosen level
    (resized by PIL's bilinear filter where the level is not the scale's). Through OpenSlide
    they are equal within 1 grey level at every scale; the raw reader is within 1 where the
    level is read as stored, and where libjpeg's DCT scaling shrinks by 2 it is a box filter
    in the DCT domain: within 1 grey level on average of the box average."""
    reader = TileReader(fine_index, context=SCALES, backend=backend, record_failures=False)
    rows = np.arange(0, len(fine_index), 3)
    result = reader.read(rows, threads=2)
    assert result.ok.all()
    slide = openslide.OpenSlide(str(fine_index.slide_path(0)))
    cols = fine_index.columns
    worst: dict[tuple[float, int], float] = {}
    for i, row in enumerate(rows.tolist()):
        x, y = int(cols["l0_x"][row]), int(cols["l0_y"][row])
        windows = reader.context_windows(row)
        for k, scale in enumerate(SCALES):
            level, l_x, l_y, read = expected_window(slide, x, y, 448, scale)
            ds = slide.level_downsamples[level]
            (_, w_x, w_y, w_level, w_read), box = windows[k]
            assert (w_level, w_read) == LEVELS[scale]
            assert (w_x, w_y) == (round(l_x * ds), round(l_y * ds))
            width, height = slide.level_dimensions[level]
            assert box == on_slide_box(l_x, l_y, read, scale[1], width, height)
            assert tuple(result.context_inside[i, k]) == box
            got = result.context[k][i].astype(np.int16)
            expected = reference(slide, level, l_x, l_y, read, scale[1], 255).astype(np.int16)
            scaled_by_dct = backend == "auto" and read == 2 * scale[1]
            if scaled_by_dct:
                box_average = rgba_to_rgb(
                    np.asarray(slide.read_region((w_x, w_y), level, (read, read)))
                )
                box_average = np.asarray(Image.fromarray(box_average).reduce(2)).copy()
                x0, y0, x1, y1 = box
                diff = np.abs(got - box_average)[y0:y1, x0:x1]
                worst[scale] = max(worst.get(scale, 0.0), float(diff.mean()))
                continue
            assert np.abs(got - expected).max() <= 1, (scale, row)
    assert worst if backend == "auto" else not worst
    assert all(mean <= 1.0 for mean in worst.values()), worst


@pytest.mark.testdata
@pytest.mark.parametrize(
    ("name", "level", "read"),
    [
        # Aperio 20x, one level: 2.0 um/px is 385 level-0 pixels resampled to 96
        ("CMU-1-Small-Region.svs", 0, 385),
        # Hamamatsu 40x (0.228 um/px), downsamples 1..64: level 3 (1.83 um/px) as stored
        ("test3-DAPI-2-(387).ndpi", 3, 96),
    ],
)
def test_context_on_real_scans_equals_openslide(
    testdata: Path, tmp_path: Path, name: str, level: int, read: int
) -> None:
    index = build_index([testdata / name], tmp_path / "idx", tile_size=128, mpp=0.5, min_tissue=0.0)
    reader = TileReader(index, context=[(2.0, 96)], record_failures=False)
    rows = np.arange(len(index))
    result = reader.read(rows, threads=2)
    assert result.ok.all() and len(rows) > 4
    slide = openslide.OpenSlide(str(testdata / name))
    ds = slide.level_downsamples[level]
    for i, row in enumerate(rows.tolist()):
        ((_, x, y, found_level, found_read), _) = reader.context_windows(row)[0]
        assert (found_level, found_read) == (level, read)
        expected = reference(slide, level, round(x / ds), round(y / ds), read, 96, 255)
        assert np.abs(result.context[0][i].astype(int) - expected).max() <= 1, row


@pytest.mark.parametrize("tile", [224, 225])
@pytest.mark.parametrize("extra", [224, 225])
def test_centring_is_exact_at_odd_and_even_sizes_and_at_edges(
    tmp_path: Path, make_slide: SlideFactory, tile: int, extra: int
) -> None:
    """A context tile of the tiles' own resolution holds the tile exactly, at its centre
    (sizes of one parity) or half a pixel right and down of it (the stated rounding), at
    every row, the slide's border rows included, where the part off the slide is filled."""
    width, height = 1536, 1024
    slide = make_slide(width=width, height=height, seed=22, mpp=0.25)
    index = build_index([slide], tmp_path / "idx", tile_size=tile, level=0, min_tissue=0.0)
    size = tile + extra
    ds = TileDataset(index, context=[(0.25, size)], fill_value=7, record_failures=False)
    batch = ds.read_batch(list(range(len(index))))
    offset = (size - tile) // 2
    centred = (size - tile) % 2 == 0
    masks = batch.context_mask(0).numpy()
    edges = 0
    for i in range(len(batch)):
        context = batch.context[0][i]
        assert np.array_equal(
            context[offset : offset + tile, offset : offset + tile], batch.images[i]
        )
        ((_, l_x, l_y, level, read), box) = ds.reader.context_windows(int(batch.rows[i]))[0]
        assert (level, read) == (0, size)
        for start, corner in ((l_x, int(batch.x[i])), (l_y, int(batch.y[i]))):
            assert (start + size / 2 == corner + tile / 2) == centred
            assert 0 <= start + size / 2 - (corner + tile / 2) <= 0.5  # halves round right/down
        assert box == on_slide_box(l_x, l_y, size, size, width, height)
        assert tuple(batch.context_inside[i, 0].tolist()) == box
        x0, y0, x1, y1 = box
        mask = masks[i]
        assert mask.sum() == (x1 - x0) * (y1 - y0) and mask[y0:y1, x0:x1].all()
        assert (context.numpy()[~mask] == 7).all()  # off the slide: the fill value
        edges += box != (0, 0, size, size)
    assert edges > 0  # the border rows reach past the slide


def test_overlapping_context_windows_share_decoded_storage_tiles(
    fine_index: SlideIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neighbouring rows (the sampler keeps locality) need mostly the same level-1 storage
    tiles for their 2.0 um/px context: each is decoded once per batch read, whatever the
    number of threads."""
    decodes: list[tuple[int, int]] = []  # (id of the level's geometry, DCT scale)
    original = Level.decode_jpeg

    def counting(self: Level, data: bytes, out=None, scale: int = 1):  # type: ignore[no-untyped-def]
        decodes.append((id(self), scale))
        return original(self, data, out, scale)

    monkeypatch.setattr(Level, "decode_jpeg", counting)
    cols = fine_index.columns
    one_row = np.flatnonzero(cols["l0_y"] == cols["l0_y"][len(fine_index) // 2])
    assert len(one_row) >= 6
    for threads in (1, 2):
        decodes.clear()
        reader = TileReader(fine_index, context=[(2.0, 224)], record_failures=False)
        reader.read(one_row, threads=threads)
        level1 = [d for d in decodes if d[0] == id(reader.get_reader(0)._levels[1])]  # type: ignore[attr-defined]
        needed = {
            (1, index)
            for row in one_row.tolist()
            for index in reader.get_reader(0)._covering(  # type: ignore[attr-defined]
                1, *_level_window(reader, row)
            )
        }
        per_window = sum(
            len(reader.get_reader(0)._covering(1, *_level_window(reader, row)))  # type: ignore[attr-defined]
            for row in one_row.tolist()
        )
        assert len(level1) == len(needed) < per_window, (threads, len(level1), per_window)


def _level_window(reader: TileReader, row: int) -> tuple[int, int, int, int]:
    ((_, x, y, level, read), _) = reader.context_windows(row)[0]
    ds = reader.get_reader(0).meta.level_downsamples[level]
    return round(x / ds), round(y / ds), read, read


@pytest.fixture(scope="module")
def broken_index(tmp_path_factory: pytest.TempPathFactory, make_slide: SlideFactory) -> SlideIndex:
    """Tiles at 2.0 um/px (level 1, intact) whose 0.5 um/px context comes from level 0, where
    storage tiles (3..4, 3..4) are corrupt."""
    slide = make_slide(width=2048, height=2048, seed=33, corrupt=[(3, 3), (4, 4)])
    out = tmp_path_factory.mktemp("broken")
    return build_index([slide], out / "idx", tile_size=64, mpp=2.0, min_tissue=0.0)


def _context_hits_corrupt(index: SlideIndex, row: int) -> bool:
    # main window: 64 px at level 1 = 256 level-0 px; context: 64 level-0 px at its centre
    x, y = int(index.columns["l0_x"][row]) + 96, int(index.columns["l0_y"][row]) + 96
    tiles = {
        (c, r)
        for c in range(x // 256, (x + 63) // 256 + 1)
        for r in range(y // 256, (y + 63) // 256 + 1)
    }
    return bool(tiles & {(3, 3), (4, 4)})


def test_a_failed_context_tile_fails_its_row(broken_index: SlideIndex) -> None:
    rows = np.arange(len(broken_index))
    hit = np.array([_context_hits_corrupt(broken_index, r) for r in rows.tolist()])
    assert 0 < hit.sum() < len(rows)
    plain = TileReader(broken_index, record_failures=False).read(rows)
    assert plain.ok.all()  # the tiles themselves are intact
    reader = TileReader(broken_index, context=[(0.5, 64)], fill_value=9, record_failures=False)
    result = reader.read(rows, threads=2)
    assert np.array_equal(~result.ok, hit)
    for i in np.flatnonzero(hit).tolist():
        assert "context 0.5 um/px" in (result.errors[i] or "")
        assert (result.pixels[i] == 9).all() and (result.context[0][i] == 9).all()
        assert (result.context_inside[i] == 0).all()
    assert any(f["kind"] == "tile" and "context" in f["error"] for f in reader.failures)
    with pytest.raises(TileReadError, match=r"context tile 1 \(64 px at 0\.5 um/px\)"):
        TileReader(broken_index, context=[(0.5, 64)], on_error="raise").read(rows)


def test_a_substitute_comes_with_its_own_context(broken_index: SlideIndex) -> None:
    rows = np.arange(len(broken_index))
    reader = TileReader(
        broken_index, context=[(0.5, 64)], on_error="substitute", record_failures=False
    )
    result = reader.read(rows)
    swapped = np.flatnonzero(result.substituted)
    assert len(swapped) > 0
    again = TileReader(broken_index, context=[(0.5, 64)], record_failures=False)
    sources = again.read(result.source_rows[swapped])
    assert np.array_equal(result.pixels[swapped], sources.pixels)
    assert np.array_equal(result.context[0][swapped], sources.context[0])


def test_scales_a_slide_cannot_serve_are_refused_naming_it(fine_index: SlideIndex) -> None:
    with pytest.raises(ConfigError, match=r"1 slides cannot serve.*scanned at 0\.25 um/px") as info:
        TileDataset(fine_index, context=[(2.0, 64), (0.1, 64)])
    assert info.value.key == "context"
    level_only = build_index(
        [fine_index.slide_path(0)], fine_index.path.parent / "levels", level=0, tile_size=512
    )
    assert TileDataset(level_only, context=[(1.0, 64)]).context == [(1.0, 64)]  # MPP known


def test_look_ahead_asks_for_the_context_windows_bytes_too(
    fine_index: SlideIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows named ahead (remote range requests, kernel read-ahead) have their context
    windows' storage segments asked for too, not only their tiles'."""
    from wsi_loader.slides import _tiff

    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(_tiff, "read_ahead", lambda fd, ranges: asked.extend(ranges))
    reader = TileReader(fine_index, context=[(2.0, 224)], record_failures=False)
    raw = reader.get_reader(0)
    rows = [0, len(fine_index) // 2]
    reader.prefetch(rows)
    levels = raw._levels  # type: ignore[attr-defined]
    level1 = {
        (int(levels[1].offsets[i]), int(levels[1].counts[i])) for i in range(len(levels[1].offsets))
    }
    needed = {
        (int(levels[1].offsets[i]), int(levels[1].counts[i]))
        for row in rows
        for i in raw._covering(1, *_level_window(reader, row))  # type: ignore[attr-defined]
    }
    assert needed and needed <= set(asked)
    assert set(asked) & level1 == needed


class _Spy:
    """A reader that records the largest region asked of it."""

    def __init__(self, reader: object) -> None:
        self._reader = reader
        self.largest = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._reader, name)

    def read_region(self, x: int, y: int, level: int, w: int, h: int) -> np.ndarray:
        self.largest = max(self.largest, w * h)
        return self._reader.read_region(x, y, level, w, h)  # type: ignore[attr-defined]


@pytest.mark.parametrize("strip_bytes", [None, 2**16])
def test_a_context_coarser_than_the_slide_reads_only_the_slide(
    fine_index: SlideIndex, monkeypatch: pytest.MonkeyPatch, strip_bytes: int | None
) -> None:
    """A scale coarser than the coarsest level (4 um/px): its window, 16 level pixels per
    output pixel, is mostly off the slide. Only the part on the slide is read (it used to read
    the whole window: 735 GiB at 1000 um/px), in strips, and the pixels are the whole window's
    resize as before."""
    from wsi_loader.dataset import _context
    from wsi_loader.slides._base import resize

    if strip_bytes is not None:
        monkeypatch.setattr(_context, "STRIP_BYTES", strip_bytes)
    reader = TileReader(fine_index, context=[(64.0, 64)], record_failures=False)
    rows = np.arange(0, len(fine_index), max(1, len(fine_index) // 5), dtype=np.int64)
    spy = _Spy(reader.get_reader(0))
    monkeypatch.setattr(reader, "get_reader", lambda slide_id: spy)
    result = reader.read(rows)
    level_area = 768 * 512
    assert 0 < spy.largest < 2 * level_area  # not the 1024 x 1024 window
    slide = openslide.OpenSlide(fine_index.slide_path(0))
    for i, row in enumerate(rows.tolist()):
        ((_, x, y, level, read), box) = reader.context_windows(row)[0]
        assert (level, read) == (2, 1024)
        whole = rgba_to_rgb(np.asarray(slide.read_region((x, y), level, (read, read))))
        expected = resize(whole, 64, 64)
        x0, y0, x1, y1 = box
        got = result.context[0][i][y0:y1, x0:x1].astype(int)
        assert np.abs(got - expected[y0:y1, x0:x1]).max() <= 1, row


def test_a_context_that_dwarfs_the_slide_is_refused(fine_index: SlideIndex) -> None:
    """A 256 px tile at 1000 um/px is 256 mm across; the slide is 0.77 mm: refused before any
    read, naming the option (it used to fail with a MemoryError)."""
    with pytest.raises(ConfigError, match="context") as caught:
        TileDataset(fine_index, context=[(1000.0, 256)])
    assert caught.value.key == "context"
    assert "times the slide" in str(caught.value)
