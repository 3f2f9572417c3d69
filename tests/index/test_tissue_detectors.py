"""Tissue detection that fits the slide: brightfield, fluorescence (dark field), a user's mask
image, an annotation class; chosen per slide and recorded, or forced."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import SlideFactory
from tests.index.annotation_files import Region, rect, write_geojson
from wsi_loader.errors import InputError
from wsi_loader.index import build_index
from wsi_loader.index._tissue import choose_detector, pixel_rule, read_mask_image, tissue_mask
from wsi_loader.slides import open_slide
from wsi_loader.synthetic import SlideSpec, tissue_of

DARK = {"width": 6000, "height": 4500, "seed": 21, "dark_field": True}


def true_tissue(spec: SlideSpec, l0_x: np.ndarray, l0_y: np.ndarray, side: int) -> np.ndarray:
    """Share of each tile the synthetic slide's tissue covers (its ground truth)."""
    mask = tissue_of(spec)
    return np.array(
        [
            mask(float(x), float(y), 8.0, side // 8, side // 8).mean()
            for x, y in zip(l0_x, l0_y, strict=True)
        ]
    )


def test_a_dark_field_slide_gets_the_fluorescence_detector(
    make_slide: SlideFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    slide = make_slide(**DARK)
    with caplog.at_level(logging.WARNING):
        index = build_index([slide], tmp_path / "i", tile_size=256, mpp=0.5)
    record = index.slides[0]
    assert record.tissue_detector == "fluorescence"
    assert record.tissue_reason is not None and "dark field" in record.tissue_reason
    assert "dark field (fluorescence)" in caplog.text  # issue 36, item 18
    # it read as if brightfield had been set: "(tissue_detector: brightfield forces ...)"
    assert "tissue_detector: brightfield forces" not in caplog.text
    assert "to find tissue by colour on them anyway, set tissue_detector: brightfield" in (
        caplog.text
    )
    grid = build_index([slide], tmp_path / "g", tile_size=256, mpp=0.5, min_tissue=0.0, qc="none")
    truth = true_tissue(SlideSpec(**DARK), grid.columns["l0_x"], grid.columns["l0_y"], 256)  # type: ignore[arg-type]
    kept = set(zip(index.columns["l0_x"].tolist(), index.columns["l0_y"].tolist(), strict=True))
    at = list(zip(grid.columns["l0_x"].tolist(), grid.columns["l0_y"].tolist(), strict=True))
    glass = [xy in kept for xy, share in zip(at, truth, strict=True) if share == 0]
    tissue = [xy in kept for xy, share in zip(at, truth, strict=True) if share > 0.9]
    assert len(glass) > 50 and len(tissue) > 20
    assert sum(glass) <= 0.05 * len(glass)  # black glass is not tissue
    assert all(tissue)
    assert np.isnan(index.columns["qc_pen"]).all()  # no ink in dark field
    assert np.isfinite(index.columns["qc_focus"]).any()


def test_forcing_brightfield_on_a_dark_slide_warns(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    index = build_index(
        [make_slide(**DARK)], tmp_path / "i", mpp=0.5, tissue_detector="brightfield"
    )
    record = index.slides[0]
    assert record.tissue_detector == "brightfield"
    assert record.warning is not None and "looks dark field" in record.warning
    forced = build_index(
        [make_slide(width=3000, height=2000, seed=1)],
        tmp_path / "f",
        tissue_detector="fluorescence",
    )
    assert forced.slides[0].tissue_detector == "fluorescence"
    assert forced.slides[0].tissue_reason.startswith("forced")  # type: ignore[union-attr]
    # the opposite case warned; this one counted the bright glass as tissue without a word
    warning = forced.slides[0].warning
    assert warning is not None and "the slide looks bright field" in warning
    assert "but tissue_detector is fluorescence" in warning and "glass" in warning


@pytest.mark.testdata
def test_forcing_fluorescence_on_cmu1_warns(testdata: Path, tmp_path: Path) -> None:
    slide = testdata / "CMU-1-Small-Region.svs"
    right = build_index([slide], tmp_path / "a", mpp=0.5, qc="none")
    forced = build_index(
        [slide], tmp_path / "f", mpp=0.5, qc="none", tissue_detector="fluorescence"
    )
    assert right.slides[0].warning is None or "looks" not in right.slides[0].warning
    assert len(forced) > len(right)  # the glass glows "tissue" under the intensity rule
    assert "the slide looks bright field" in (forced.slides[0].warning or "")


def test_brightfield_slides_keep_the_colour_rule(make_slide: SlideFactory) -> None:
    with open_slide(str(make_slide(width=3000, height=2000, seed=1))) as reader:
        image, _ = read_mask_image(reader, 512)
    detector, why = choose_detector(image)
    assert detector == "brightfield" and "bright field" in why
    # the default rule is the one the index always used
    assert np.array_equal(tissue_mask(image), tissue_mask(image, pixel_rule(image, "brightfield")))


@pytest.mark.testdata
def test_the_ndpi_background_is_not_tissue(testdata: Path, tmp_path: Path) -> None:
    """The DAPI NDPI: every tile, black background included, was "tissue 1.00" (issue 38)."""
    ndpi = testdata / "test3-DAPI-2-(387).ndpi"
    index = build_index([ndpi], tmp_path / "i", tile_size=256, mpp=0.5)
    assert index.slides[0].tissue_detector == "fluorescence"
    grid = build_index([ndpi], tmp_path / "g", tile_size=256, mpp=0.5, min_tissue=0.0)
    record = grid.slides[0]
    footprint = round((record.read_size or 0) * (record.read_downsample or 1.0))
    glass = []  # share of each grid tile's level-2 pixels at the glass's level (2-4/255)
    with open_slide(str(ndpi)) as reader:
        side = int(footprint / reader.meta.level_downsamples[2])
        for x, y in zip(grid.columns["l0_x"].tolist(), grid.columns["l0_y"].tolist(), strict=True):
            glass.append((reader.read_region(x, y, 2, side, side).max(axis=-1) <= 7).mean())
    share = np.array(glass)
    at = list(zip(grid.columns["l0_x"].tolist(), grid.columns["l0_y"].tolist(), strict=True))
    kept = set(zip(index.columns["l0_x"].tolist(), index.columns["l0_y"].tolist(), strict=True))
    mostly_glass = [xy for xy, g in zip(at, share, strict=True) if g >= 0.6]
    assert len(mostly_glass) >= 5
    assert not kept & set(mostly_glass)
    assert (grid.columns["tissue"][share >= 0.9] < 0.1).all()
    old_rule = build_index([ndpi], tmp_path / "b", tile_size=256, mpp=0.5,
                           tissue_detector="brightfield")  # fmt: skip
    assert len(old_rule) == len(grid)  # colour on a dark slide: everything "tissue"


def write_mask(path: Path, size: tuple[int, int], left_share: float) -> Path:
    """A mask image whose left ``left_share`` is white (tissue)."""
    mask = np.zeros((size[1], size[0]), dtype=np.uint8)
    mask[:, : int(size[0] * left_share)] = 255
    Image.fromarray(mask).save(path)
    return path


def test_a_mask_image_is_the_tissue(make_slide: SlideFactory, tmp_path: Path) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    shutil.copy(make_slide(width=4096, height=3072, seed=1), slides / "a.svs")
    shutil.copy(make_slide(width=4096, height=3072, seed=2), slides / "b.svs")
    masks = tmp_path / "masks"
    masks.mkdir()
    write_mask(masks / "a_mask.png", (400, 300), 0.5)
    index = build_index([slides], tmp_path / "i", tile_size=256, level=0, tissue_masks=str(masks))
    a, b = index.slides
    assert (a.tissue_detector, b.tissue_detector) == ("mask", "brightfield")
    rows = index.columns["slide_id"] == 0
    assert (index.columns["l0_x"][rows] + 256 <= 2048 + 1).all()  # only the left half
    assert rows.sum() == 8 * 12  # every tile of the left half, tissue or not
    # a changed mask re-indexes its slide, the other is carried over
    write_mask(masks / "a_mask.png", (400, 300), 0.25)
    again = build_index([slides], tmp_path / "i", tile_size=256, level=0, tissue_masks=str(masks))
    assert again.meta["build"] == {"unchanged": 1, "indexed": 1}
    assert (again.columns["slide_id"] == 0).sum() == 4 * 12


def test_masks_that_do_not_fit_fail_their_slide(
    make_slide: SlideFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slide = make_slide(width=4096, height=3072, seed=1)
    wrong = write_mask(tmp_path / "wrong.png", (300, 300), 1.0)
    index = build_index([slide], tmp_path / "i", level=0, tissue_masks=str(wrong))
    record = index.slides[0]
    assert record.status == "failed"
    assert "aspect ratios differ" in (record.error or "") and "wrong.png" in (record.error or "")
    monkeypatch.setattr("wsi_loader.index._tissue_masks.MAX_MASK_PIXELS", 1000)
    big = write_mask(tmp_path / "big.png", (400, 300), 1.0)
    index = build_index([slide], tmp_path / "j", level=0, tissue_masks=str(big))
    assert "more than the 1,000 pixels allowed" in (index.slides[0].error or "")
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not a picture")
    index = build_index([slide], tmp_path / "k", level=0, tissue_masks=str(garbage))
    assert "cannot read the tissue mask" in (index.slides[0].error or "")
    with pytest.raises(InputError, match="no tissue mask matches any slide"):
        build_index([slide], tmp_path / "l", level=0, tissue_masks=str(tmp_path / "i"))


def test_masks_listed_in_a_csv(make_slide: SlideFactory, tmp_path: Path) -> None:
    slide = make_slide(width=4096, height=3072, seed=1)
    write_mask(tmp_path / "m.png", (400, 300), 0.5)
    table = tmp_path / "masks.csv"
    table.write_text(f"slide,mask\n{slide.stem},m.png\n")
    index = build_index([slide], tmp_path / "i", tile_size=256, level=0, tissue_masks=str(table))
    assert index.slides[0].tissue_detector == "mask"
    assert len(index) == 8 * 12


def test_a_misspelt_column_of_the_masks_table_is_named_with_the_one_meant(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    slide = make_slide(width=4096, height=3072, seed=1)
    write_mask(tmp_path / "m.png", (400, 300), 0.5)
    table = tmp_path / "masks.csv"
    table.write_text(f"slide,msk\n{slide.stem},m.png\n")
    with pytest.raises(InputError, match="did you mean 'mask'") as caught:
        build_index([slide], tmp_path / "i", level=0, tissue_masks=str(table))
    assert str(table) in str(caught.value)


def test_an_annotation_class_is_the_tissue(make_slide: SlideFactory, tmp_path: Path) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    shutil.copy(make_slide(width=4096, height=3072, seed=1), slides / "a.svs")
    write_geojson(slides / "a.geojson", [Region("Tissue", rect(0, 0, 1024, 1024))])
    index = build_index([slides], tmp_path / "i", tile_size=256, level=0,
                        annotations=str(slides), tissue_class="Tissue")  # fmt: skip
    assert index.slides[0].tissue_detector == "annotation"
    assert len(index) == 16
    assert (index.columns["tissue"] == 1).all()
    with pytest.raises(InputError, match="tissue_class: no annotation file has"):
        build_index([slides], tmp_path / "j", level=0, annotations=str(slides),
                    tissue_class="Tisue")  # fmt: skip
