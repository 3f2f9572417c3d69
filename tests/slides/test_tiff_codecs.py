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
from wsi_loader.slides.base import rgba_to_rgb
from wsi_loader.slides.tiff_backend import TiffReader


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
    from wsi_loader.dataset.reading import TileReader
    from wsi_loader.slides import tiff_backend

    def bug(*args: object, **kwargs: object) -> None:
        raise TypeError("a bug, not bad data")

    monkeypatch.setattr(tiff_backend._Level, "decode_jpeg", bug)
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
    with pytest.raises(SlideOpenError, match="Unsupported TIFF compression: 6"):
        open_slide(str(path))  # OpenSlide detects it and says why
    reader = TiffReader(str(path))  # the raw reader decodes it
    got = reader.read_region(0, 0, 0, 128, 128)
    assert abs(int(got[0, 0, 0]) - 0) <= 2 and abs(int(got[0, 100, 0]) - 200) <= 2
    reader.close()
