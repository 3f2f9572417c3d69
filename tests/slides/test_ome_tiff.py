"""OME-TIFF pyramids (bfconvert, QuPath's and Bio-Formats' exporters, tifffile): the pixel size
lives in the OME-XML (``PhysicalSizeX`` with its unit), the reduced levels in SubIFDs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tifffile

from wsi_loader.index import build_index
from wsi_loader.slides import open_slide
from wsi_loader.slides._tiff_meta import ome_mpps

SIZE = (1536, 2048)  # height, width


def _image() -> np.ndarray:
    """White background with a dark 'tissue' block, so tissue detection finds something."""
    rng = np.random.default_rng(7)
    image = np.full((*SIZE, 3), 235, np.uint8)
    image[300:1200, 400:1600] = rng.integers(60, 160, (900, 1200, 3), dtype=np.uint8)
    return image


def write_ome_pyramid(
    path: Path,
    size_x: float | str | None,
    unit: str | None = None,
    resolution_um: float | None = None,
    size_y: float | None = None,
) -> Path:
    """A 3-level OME-TIFF as tifffile's documented pyramid recipe writes it: the base in the
    main IFD, reduced levels in its SubIFDs, OME-XML in the first ImageDescription."""
    base = _image()
    metadata: dict[str, object] = {"axes": "YXS"}
    if size_x is not None:
        metadata.update(PhysicalSizeX=size_x, PhysicalSizeY=size_x if size_y is None else size_y)
    if unit is not None:
        metadata.update(PhysicalSizeXUnit=unit, PhysicalSizeYUnit=unit)
    options: dict[str, object] = dict(tile=(256, 256), compression="jpeg", photometric="rgb")
    if resolution_um is not None:
        options.update(resolution=(1e4 / resolution_um,) * 2, resolutionunit="CENTIMETER")
    with tifffile.TiffWriter(path, ome=True) as tif:
        tif.write(base, subifds=2, metadata=metadata, **options)
        for ds in (2, 4):
            tif.write(base[::ds, ::ds], subfiletype=1, metadata=None, **options)
    return path


def test_ome_tiff_pyramid_reads_its_levels_and_physical_size(tmp_path: Path) -> None:
    path = write_ome_pyramid(tmp_path / "scan one.ome.tif", 0.5, "µm")
    reader = open_slide(str(path))
    try:
        meta = reader.meta
        assert reader.backend == "tiff"
        assert meta.level_dimensions == ((2048, 1536), (1024, 768), (512, 384))
        assert meta.mpp == pytest.approx(0.5)
        assert meta.mpp_source == "vendor"
        tile = reader.read_region(512, 512, 1, 64, 64)
        assert tile.shape == (64, 64, 3)
    finally:
        reader.close()


@pytest.mark.parametrize(
    ("size_x", "unit", "mpp"),
    [
        (0.25, None, 0.25),  # OME's default unit is the micrometre
        (250, "nm", 0.25),
        (0.00025, "mm", 0.25),
        (2.5e-7, "m", 0.25),
        (0.25, "\u03bcm", 0.25),  # Greek mu, as some writers spell it
    ],
)
def test_ome_physical_size_units(
    tmp_path: Path, size_x: float, unit: str | None, mpp: float
) -> None:
    path = write_ome_pyramid(tmp_path / "slide.ome.tif", size_x, unit)
    reader = open_slide(str(path))
    try:
        assert reader.meta.mpp == pytest.approx(mpp)
        assert reader.meta.mpp_source == "vendor"
    finally:
        reader.close()


def test_ome_without_physical_size_falls_back_to_the_resolution_tags(tmp_path: Path) -> None:
    path = write_ome_pyramid(tmp_path / "slide.ome.tif", None, resolution_um=0.5)
    reader = open_slide(str(path))
    try:
        assert reader.meta.mpp == pytest.approx(0.5)
        assert reader.meta.mpp_source == "tiff-resolution"
    finally:
        reader.close()


@pytest.mark.parametrize(("size_x", "unit"), [(0.5, "pixel"), (0.5, "parsec"), (-1.0, "µm")])
def test_ome_physical_size_that_is_not_a_length_is_missing(
    tmp_path: Path, size_x: float, unit: str
) -> None:
    path = write_ome_pyramid(tmp_path / "slide.ome.tif", size_x, unit)
    reader = open_slide(str(path))
    try:
        assert reader.meta.mpp is None
        assert reader.meta.mpp_source == "missing"
    finally:
        reader.close()


def test_malformed_ome_xml_opens_without_an_mpp(tmp_path: Path) -> None:
    """A broken description is not a broken slide: tifffile then reads the levels as a plain
    pyramid, and the pixel size is missing (the index says so) instead of a crash."""
    path = write_ome_pyramid(tmp_path / "slide.ome.tif", 0.5, "µm")
    data = bytearray(path.read_bytes())
    end = data.index(b"</OME>")
    data[end : end + 6] = b"</OMX>"  # mismatched tag; same length, so offsets stay valid
    path.write_bytes(bytes(data))
    reader = open_slide(str(path))
    try:
        assert reader.meta.mpp is None
    finally:
        reader.close()


def test_ome_tiff_is_indexed_at_a_target_mpp(tmp_path: Path) -> None:
    """Was: the slide failed with 'no MPP' and none of its tiles were indexed."""
    folder = tmp_path / "archive"
    folder.mkdir()
    write_ome_pyramid(folder / "case.1 scan.ome.tif", 0.25, "µm")
    index = build_index([folder], tmp_path / "idx", tile_size=256, mpp=0.5, min_tissue=0.5)
    (slide,) = index.slides
    assert slide.status == "ok", slide
    assert slide.mpp == pytest.approx(0.25) and slide.read_level == 1
    assert len(index) > 0
    assert np.all(index.columns["level"][:] == 1)


@pytest.mark.parametrize(
    "xml",
    [
        '<OME><Image><Pixels PhysicalSizeX="0.5"',  # truncated
        '<?xml version="1.0"?><!DOCTYPE OME [<!ENTITY a "0.5">]>'
        '<OME><Image><Pixels PhysicalSizeX="&a;"/></Image></OME>',  # entities are refused
        '<OME><Image><Pixels PhysicalSizeX="half"/></Image></OME>',
        '<OME><Image><Pixels PhysicalSizeX="nan"/></Image></OME>',
        "<OME><Image/></OME>",
    ],
)
def test_unusable_ome_xml_gives_no_mpp(xml: str) -> None:
    assert ome_mpps(xml)[0] is None


def test_ome_mpp_reads_the_first_image_with_any_schema_namespace() -> None:
    xml = (
        '<OME xmlns="http://www.openmicroscopy.org/Schemas/OME/2016-06">'
        '<Image ID="Image:0"><Pixels PhysicalSizeX="0.2628" PhysicalSizeXUnit="µm"/></Image>'
        '<Image ID="Image:1"><Pixels PhysicalSizeX="12.0"/></Image></OME>'
    )
    assert ome_mpps(xml)[0] == pytest.approx(0.2628)


def test_ome_pixels_that_are_not_square_are_said_in_the_index(tmp_path: Path) -> None:
    folder = tmp_path / "slides"
    folder.mkdir()
    write_ome_pyramid(folder / "tall.ome.tif", 0.25, "µm", size_y=0.3)
    index = build_index([folder], tmp_path / "idx", mpp=0.5, tile_size=128)
    (record,) = index.slides
    assert record.status == "ok" and record.mpp == pytest.approx(0.25)
    assert "pixels are not square (0.25 um across, 0.3 um down)" in (record.warning or "")
