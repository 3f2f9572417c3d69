"""The raw TIFF reader on files other software writes: JPEG in strips, 12-bit JPEG, partly
transparent RGBA (unassociated and associated alpha), and codecs it cannot decode. Pixels
match OpenSlide exactly where OpenSlide reads the file, tifffile's own decode otherwise, and
no error message reaching a user is empty."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openslide
import pytest
import tifffile

from wsi_loader.errors import SlideOpenError, TileReadError
from wsi_loader.slides import open_slide
from wsi_loader.slides._base import rgba_to_rgb
from wsi_loader.slides._tiff import TiffReader


def noise(shape: tuple[int, ...], top: int = 255, dtype: type = np.uint8) -> np.ndarray:
    return np.random.default_rng(7).integers(0, top + 1, shape).astype(dtype)


def test_jpeg_in_strips_decodes(tmp_path: Path) -> None:
    path = tmp_path / "strips.tif"
    image = np.zeros((300, 400, 3), np.uint8)
    image[:, :200] = (200, 40, 90)
    image[:, 200:] = (30, 180, 60)
    tifffile.imwrite(path, image, compression="jpeg", rowsperstrip=16, photometric="rgb")
    reader = open_slide(str(path))  # OpenSlide rejects JPEG strips: auto goes raw
    assert isinstance(reader, TiffReader)
    got = reader.read_region(0, 0, 0, 400, 300)
    expected = tifffile.imread(path)
    np.testing.assert_array_equal(got, expected)
    assert np.abs(got.astype(int) - image).mean() < 3  # and it is the picture (lossy)
    reader.close()


def test_12_bit_jpeg_is_scaled_by_its_bits(tmp_path: Path) -> None:
    path = tmp_path / "j12.tif"
    grey = np.full((128, 128), 4095, np.uint16)
    grey[64:] = 2048
    tifffile.imwrite(path, grey, tile=(64, 64), compression="jpeg", bitspersample=12)
    reader = TiffReader(str(path))
    got = reader.read_region(0, 0, 0, 128, 128)
    assert got.shape == (128, 128, 3)
    assert abs(int(got[0, 0, 0]) - 255) <= 1  # 4095 is white, not 4095 / 65535 of it
    assert abs(int(got[100, 0, 0]) - 128) <= 1
    reader.close()


@pytest.mark.parametrize("kind", ["unassociated", "associated", "unspecified"])
def test_partly_transparent_rgba_matches_openslide_exactly(tmp_path: Path, kind: str) -> None:
    rgba = noise((256, 256, 4))
    if kind != "unassociated":  # premultiplied data never exceeds its alpha
        rgba[..., :3] = (rgba[..., :3].astype(int) * rgba[..., 3:] // 255).astype(np.uint8)
    path = tmp_path / f"{kind}.tif"
    extra = {"unassociated": 2, "associated": 1, "unspecified": 0}[kind]
    tifffile.imwrite(
        path, rgba, tile=(64, 64), photometric="rgb", compression="zlib", extrasamples=[extra]
    )
    with openslide.OpenSlide(str(path)) as slide:
        expected = rgba_to_rgb(np.asarray(slide.read_region((0, 0), 0, (256, 256))))
    reader = TiffReader(str(path))
    np.testing.assert_array_equal(reader.read_region(0, 0, 0, 256, 256), expected)
    reader.close()


def test_an_undecodable_codec_says_why_on_every_read(testdata: Path) -> None:
    reader = TiffReader(str(testdata / "unopenable.tiff"))  # compression 52479
    for _ in range(2):
        with pytest.raises(TileReadError) as caught:
            reader.read_region(0, 0, 0, 1, 1)
        assert "52479" in str(caught.value) and caught.value.cause
    reader.close()


def test_a_truncated_tiff_names_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "cut.tif"
    path.write_bytes(b"II*\x00\x08\x00\x00\x00")  # a header and nothing else
    with pytest.raises(SlideOpenError) as caught:
        TiffReader(str(path))
    assert "no image in the file" in str(caught.value)


def test_empty_exception_messages_become_readable() -> None:
    from wsi_loader.errors import describe

    try:
        raise AssertionError
    except AssertionError as exc:
        text = describe(exc)
    assert text.startswith("AssertionError (no message) at ") and "test_tiff_codecs" in text
    error = TileReadError.for_region("s.tif", 0, 0, 0, 1, 1, KeyError())
    assert "KeyError (no message)" in str(error)


def test_a_programming_error_propagates_instead_of_becoming_a_bad_tile(
    index, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    from wsi_loader.dataset._reading import TileReader
    from wsi_loader.slides._tiff_decode import Level

    def bug(*args: object, **kwargs: object) -> None:
        raise TypeError("a bug, not bad data")

    monkeypatch.setattr(Level, "decode_jpeg", bug)
    reader = TileReader(index)
    with pytest.raises(TypeError, match="a bug"):
        reader.read([0, 1], threads=1)
    with pytest.raises(TypeError, match="a bug"):
        reader.read(list(range(8)), threads=2)
    assert reader.failures == [] and index.quarantine.read() == []
    with pytest.raises(IndexError):  # a level the slide does not have
        TiffReader(str(index.slide_path(0))).read_region(0, 0, 7, 16, 16)


def test_old_style_jpeg_compression_tag_reads_or_says_why(tmp_path: Path) -> None:
    path = tmp_path / "ojpeg.tif"
    image = np.zeros((128, 128, 3), np.uint8)
    image[:, 64:] = 200
    tifffile.imwrite(path, image, compression="jpeg", tile=(64, 64), photometric="rgb")
    with tifffile.TiffFile(path) as tif:
        offset = tif.pages[0].tags["Compression"].valueoffset
    data = bytearray(path.read_bytes())
    data[offset] = 6  # Compression 6: old-style JPEG
    path.write_bytes(bytes(data))
    with pytest.raises(openslide.OpenSlideError, match="Unsupported TIFF compression: 6"):
        openslide.OpenSlide(str(path))
    reader = open_slide(str(path))  # the raw reader decodes it, so it reads it by default
    assert isinstance(reader, TiffReader)
    got = reader.read_region(0, 0, 0, 128, 128)
    assert abs(int(got[0, 0, 0]) - 0) <= 2 and abs(int(got[0, 100, 0]) - 200) <= 2
    reader.close()


def _image(shape: tuple[int, ...] = (192, 160, 3)) -> np.ndarray:
    """A smooth picture with some noise (every codec here compresses it, lossy ones well)."""
    y, x = np.mgrid[0 : shape[0], 0 : shape[1]]
    base = np.stack([x * 255 // shape[1], y * 255 // shape[0], (x + y) % 256], axis=-1)
    return (base[..., : shape[2]] + noise(shape, 8)).clip(0, 255).astype(np.uint8)


@pytest.mark.parametrize("codec", ["png", "lzma", "lerc", "jpegxr", "jpegxl", "webp"])
def test_codecs_openslide_lacks_are_read_by_default(tmp_path: Path, codec: str) -> None:
    """OpenSlide cannot open these tiled TIFFs ('Unsupported TIFF compression'), and the
    default backend stopped there although the raw reader decodes them exactly."""
    path = tmp_path / f"{codec}.tif"
    tifffile.imwrite(path, _image(), tile=(64, 64), photometric="rgb", compression=codec)
    with pytest.raises(openslide.OpenSlideError, match="Unsupported TIFF compression"):
        openslide.OpenSlide(str(path))
    reader = open_slide(str(path))
    assert isinstance(reader, TiffReader)
    np.testing.assert_array_equal(reader.read_region(0, 0, 0, 160, 192), tifffile.imread(path))
    reader.close()


def _old_style_jpeg_strips(path: Path, decodable: bool) -> None:
    """JPEG strips under the old-style Compression 6. ``decodable=False``: the strips hold the
    entropy-coded data only, as real old-style files do (the stream's header is elsewhere)."""
    tifffile.imwrite(path, _image(), compression="jpeg", rowsperstrip=32, photometric="rgb")
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        offset = page.tags["Compression"].valueoffset
        strips = list(page.dataoffsets)
    data = bytearray(path.read_bytes())
    data[offset] = 6
    if not decodable:
        for start in strips:
            data[start : start + 2] = b"\0\0"  # no start-of-image marker
    path.write_bytes(bytes(data))


def test_old_style_jpeg_that_cannot_be_decoded_is_refused_when_indexed(tmp_path: Path) -> None:
    """Such a file indexed as ok, then every tile failed with 'Not a JPEG file'."""
    from wsi_loader import build_index

    folder = tmp_path / "slides"
    folder.mkdir()
    _old_style_jpeg_strips(folder / "ojpeg.tif", decodable=False)
    index = build_index([folder], tmp_path / "idx", level=0, tile_size=64, min_tissue=0.0)
    assert index.slides[0].status == "failed" and len(index) == 0
    assert "Not a JPEG file" in (index.slides[0].error or "")
    with pytest.raises(SlideOpenError, match=r"old-style JPEG.*Not a JPEG file"):
        TiffReader(str(folder / "ojpeg.tif"))
    _old_style_jpeg_strips(folder / "ojpeg.tif", decodable=True)  # JPEG streams: read
    index = build_index([folder], tmp_path / "idx", level=0, tile_size=64, min_tissue=0.0)
    assert index.slides[0].status == "ok" and len(index) > 0


def test_grey_16_bit_tiles_are_read_whole_by_default(tmp_path: Path) -> None:
    """OpenSlide returns wrong pixels at the edge of 16-bit grey tiled levels (partial edge
    tiles); the default backend reads them with the raw reader, libtiff's way (the high
    byte), so that the inside matches OpenSlide exactly and the edge holds the data."""
    grey = noise((300, 200), 65535, np.uint16)
    path = tmp_path / "gray.tiled.u2.tif"
    tifffile.imwrite(path, grey, tile=(64, 64), photometric="minisblack")
    with openslide.OpenSlide(str(path)) as slide:
        theirs = np.asarray(slide.read_region((0, 0), 0, (200, 300)))[..., :3]
    reader = open_slide(str(path))
    assert isinstance(reader, TiffReader)
    ours = reader.read_region(0, 0, 0, 200, 300)
    expected = np.repeat((grey >> 8).astype(np.uint8)[..., None], 3, axis=-1)
    np.testing.assert_array_equal(ours, expected)
    np.testing.assert_array_equal(ours[:256, :192], theirs[:256, :192])
    assert not np.array_equal(theirs, expected)  # OpenSlide's edge is wrong
    reader.close()


def test_a_file_of_two_rgb_pages_says_it_reads_the_first_in_colour(tmp_path: Path) -> None:
    """The note said 'only channel 0 is read, as grey' of RGB pages read in colour."""
    pages = np.stack([_image(), 255 - _image()])
    path = tmp_path / "two.tif"
    tifffile.imwrite(path, pages, tile=(64, 64), photometric="rgb")
    reader = TiffReader(str(path))
    note = reader.meta.note or ""
    assert "2 images" in note and "only the first is read, in colour" in note
    assert "grey" not in note
    np.testing.assert_array_equal(reader.read_region(0, 0, 0, 160, 192), pages[0])
    reader.close()
    channels = noise((3, 128, 128))  # grey pages: fluorescence channels (a stack, to tifffile)
    path = tmp_path / "channels.tif"
    tifffile.imwrite(path, channels, tile=(64, 64), photometric="minisblack")
    assert "3 channels (QYX); only channel 0 is read, as grey" in (
        TiffReader(str(path)).meta.note or ""
    )


def test_a_folder_of_such_slides_indexes_and_reads_exactly(tmp_path: Path) -> None:
    from wsi_loader import TileDataset, build_index

    folder = tmp_path / "slides"
    folder.mkdir()
    for codec in ("png", "lzma"):
        tifffile.imwrite(
            folder / f"{codec}.tif", _image((256, 256, 3)), tile=(64, 64), compression=codec
        )
    index = build_index([folder], tmp_path / "idx", level=0, tile_size=128, min_tissue=0.0)
    assert [s.status for s in index.slides] == ["ok", "ok"] and len(index) == 8
    assert {s.backend for s in index.slides} == {"tiff"}
    batch = TileDataset(index).read_batch([0, 7])
    assert bool(batch.ok.all())
    image = batch.images.numpy()
    np.testing.assert_array_equal(image[0], _image((256, 256, 3))[:128, :128])  # NHWC
