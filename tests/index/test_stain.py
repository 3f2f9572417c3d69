"""Per-slide stain estimates in the index (index/_stain_estimates.py and the builder's columns)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tifffile

from tests.conftest import SlideFactory
from wsi_loader.cli.main import main
from wsi_loader.dataset import TileDataset
from wsi_loader.errors import InputError, TileReadError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index import _analyses as analyses
from wsi_loader.index import _stain_estimates as index_stain
from wsi_loader.index._stain_estimates import (
    StainEstimate,
    angle_deg,
    archive_reference,
    estimate_stain,
    read_reference,
    write_reference,
)
from wsi_loader.index._stain_sampling import read_tissue_sample, slide_estimate
from wsi_loader.index._tissue import read_mask_image, tissue_mask
from wsi_loader.slides._base import SlideReader
from wsi_loader.slides._open import open_slide

# two known stainings for synthetic slides: Macenko's reference vectors, and a bluer H with a
# redder E (another lab's)
KNOWN = {
    "macenko": ((0.5626, 0.7201, 0.4062), (0.2159, 0.8012, 0.5581)),
    "other": ((0.65, 0.70, 0.29), (0.30, 0.80, 0.45)),
}


def _level0_estimate(index, slide_id: int) -> StainEstimate:  # type: ignore[no-untyped-def]
    """The stain of a slide's level-0 tissue tiles (tiles at least half tissue, pooled)."""
    cols = index.columns
    rows = np.flatnonzero((cols["slide_id"] == slide_id) & (cols["tissue"] >= 0.5))[:400]
    assert len(rows) >= 10
    pixels = TileDataset(index).reader.read(rows).pixels
    found = estimate_stain(pixels.reshape(-1, 3))
    assert isinstance(found, StainEstimate), found
    return found


@pytest.mark.parametrize("staining", sorted(KNOWN))
def test_synthetic_slide_vectors_from_the_low_level(
    staining: str, make_slide: SlideFactory, tmp_path: Path
) -> None:
    h, e = KNOWN[staining]
    slide = make_slide(width=6000, height=5000, seed=3, stain=(h, e))
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    record = index.slides[0]
    assert record.stain_error is None and record.stain is not None
    low = StainEstimate.from_json(record.stain)
    assert index.slides[0].mask_level == 2  # the estimate came from the lowest level (1/16)
    level0 = _level0_estimate(index, 0)
    assert angle_deg(low.h, level0.h) <= 5.0
    assert angle_deg(low.e, level0.e) <= 5.0
    # Macenko's robust extremes (1st/99th percentile angles) lie a little beyond the true
    # vectors on noisy JPEG pixels: within 10 degrees of the vectors the slide was stained with
    assert angle_deg(low.h, h) <= 10.0
    assert angle_deg(low.e, e) <= 10.0


@pytest.mark.parametrize(
    ("name", "source"),
    [
        # two levels, tiles read from level 0: 16 of level 0's storage tiles (the pixels the
        # tiles are made of)
        ("tcga-cr-7395-01a-01-ts1.svs", "level 0, 16 tiles"),
        # one level: its mask image is level 0 shrunk 2x, whose averaged intensities put E
        # 7.2 degrees from level 0's; the estimate comes from 16 of its storage tiles instead
        ("CMU-1-Small-Region.svs", "level 0, 16 tiles"),
    ],
)
def test_real_slide_vectors_from_the_low_level(
    name: str, source: str, testdata: Path, tmp_path: Path
) -> None:
    index = build_index([testdata / name], tmp_path / "idx", tile_size=224, level=0)
    record = index.slides[0]
    assert record.stain is not None, record.stain_error
    low = StainEstimate.from_json(record.stain)
    assert low.source == source
    level0 = _level0_estimate(index, 0)
    assert angle_deg(low.h, level0.h) <= 5.0
    assert angle_deg(low.e, level0.e) <= 5.0
    assert angle_deg(low.h, low.e) > 10  # two stains, H the one with more red
    assert low.h[0] > low.e[0]
    # the peer's reference: torchstain's Macenko fit on the same level-0 tissue tiles
    # (measured CMU-1 H 1.4 / E 0.4 degrees, TCGA 1.1 / 1.3 from 16 of its level-1 tiles)
    torchstain = pytest.importorskip("torchstain")
    torch = pytest.importorskip("torch")
    cols = index.columns
    rows = np.flatnonzero(cols["tissue"] >= 0.5)[:400]
    pixels = TileDataset(index).reader.read(rows).pixels
    side_by_side = np.ascontiguousarray(pixels.reshape(-1, pixels.shape[2], 3))
    peer = torchstain.normalizers.MacenkoNormalizer(backend="torch")
    peer.fit(torch.from_numpy(side_by_side).permute(2, 0, 1))
    he = peer.HERef.numpy()
    assert angle_deg(low.h, he[:, 0]) <= 5.0
    assert angle_deg(low.e, he[:, 1]) <= 5.0


def _single_level(source: Path, out: Path) -> Path:
    """Level 0 of a synthetic slide as a generic tiled TIFF with no pyramid (JPEG, 256 px)."""
    with open_slide(str(source)) as reader:
        pixels = reader.read_region(0, 0, 0, *reader.meta.level_dimensions[0])
    tifffile.imwrite(
        out, pixels, tile=(256, 256), compression="jpeg", photometric="rgb",
        resolution=(20_000, 20_000), resolutionunit="CENTIMETER",
    )  # fmt: skip
    return out


@pytest.mark.parametrize("staining", sorted(KNOWN))
def test_single_level_slide_is_sampled_at_full_resolution(
    staining: str, make_slide: SlideFactory, tmp_path: Path
) -> None:
    h, e = KNOWN[staining]
    slide = _single_level(make_slide(width=4000, height=3000, seed=5, stain=(h, e)),
                          tmp_path / "one-level.tiff")  # fmt: skip
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    record = index.slides[0]
    assert record.mask_level == 0 and record.stain is not None, record.stain_error
    low = StainEstimate.from_json(record.stain)
    assert low.source == "level 0, 16 tiles"
    level0 = _level0_estimate(index, 0)
    assert angle_deg(low.h, level0.h) <= 5.0
    assert angle_deg(low.e, level0.e) <= 5.0
    assert angle_deg(low.h, h) <= 10.0
    assert angle_deg(low.e, e) <= 10.0
    # tiles read at level 1 (2 um/px) of a pyramid whose mask image is level 2 (8 um/px):
    # sampled at level 1, never at level 0
    pyramid = make_slide(width=4000, height=3000, seed=5, stain=(h, e))
    index = build_index([pyramid], tmp_path / "idx2", tile_size=256, level=1)
    assert StainEstimate.from_json(index.slides[0].stain or {}).source.startswith("level 1, ")


def test_an_unreadable_sample_falls_back_to_the_mask_image(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    slide = _single_level(make_slide(width=3000, height=2600, seed=5, stain=KNOWN["macenko"]),
                          tmp_path / "one-level.tiff")  # fmt: skip

    class Failing:  # the mask image reads, the full-resolution windows fail
        def __init__(self, reader: SlideReader) -> None:
            self.meta, self.path = reader.meta, reader.path

        def read_region(self, l0_x: int, l0_y: int, level: int, w: int, h: int) -> None:
            raise TileReadError.for_region(self.path, l0_x, l0_y, level, w, h, OSError("bad"))

    with open_slide(str(slide)) as reader:
        image, level = read_mask_image(reader, 1024)
        found = slide_estimate(Failing(reader), image, tissue_mask(image), level, 0)  # type: ignore[arg-type]
        sampled = slide_estimate(reader, image, tissue_mask(image), level, 0)
    assert isinstance(found, StainEstimate) and found.source == "level 0"
    assert isinstance(sampled, StainEstimate) and sampled.source == "level 0, 16 tiles"


def test_slides_without_an_estimate_are_flagged_not_failed(testdata: Path, tmp_path: Path) -> None:
    inputs = [testdata / "small.svs", testdata / "test3-DAPI-2-(387).ndpi"]
    index = build_index(inputs, tmp_path / "idx", tile_size=16, level=0, min_tissue=0.0)
    by_name = {os.path.basename(s.path): s for s in index.slides}
    assert all(s.status == "ok" for s in index.slides)
    assert "too little stained tissue" in (by_name["small.svs"].stain_error or "")
    assert by_name["test3-DAPI-2-(387).ndpi"].stain is None
    assert by_name["test3-DAPI-2-(387).ndpi"].stain_error


def test_uniform_image_gives_a_reason() -> None:
    grey = np.full((100, 100, 3), 120, np.uint8)  # grey is no stain (bubble rims, dust)
    assert "too little stained tissue" in str(estimate_stain(grey))
    purple = np.full((100, 100, 3), (150, 90, 170), np.uint8)  # one colour: one stain
    assert "not separable" in str(estimate_stain(purple))
    white = np.full((100, 100, 3), 250, np.uint8)
    assert "too little stained tissue" in str(estimate_stain(white))


def test_rebuild_estimates_only_changed_slides(
    make_slide: SlideFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "slides"
    folder.mkdir()
    for seed in (1, 2):
        shutil.copy(make_slide(width=3000, height=2000, seed=seed), folder / f"s{seed}.svs")
    first = build_index([folder], tmp_path / "idx", tile_size=256, level=0)
    assert all(s.stain is not None for s in first.slides)
    seen: list[int] = []
    real = analyses.stain_columns

    def counting(reader, rgb, *args):  # type: ignore[no-untyped-def]
        seen.append(rgb.shape[0])
        return real(reader, rgb, *args)

    monkeypatch.setattr(analyses, "stain_columns", counting)  # where the builder runs it
    again = build_index([folder], tmp_path / "idx", tile_size=256, level=0)
    assert seen == []  # carried over with their stain
    assert [s.stain for s in again.slides] == [s.stain for s in first.slides]
    shutil.copy(make_slide(width=3000, height=2000, seed=5), folder / "s2.svs")
    changed = build_index([folder], tmp_path / "idx", tile_size=256, level=0)
    assert len(seen) == 1
    assert changed.slides[0].stain == first.slides[0].stain
    assert changed.slides[1].stain != first.slides[1].stain


def test_records_from_before_stain_columns_are_indexed_again(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    slide = make_slide(width=3000, height=2000, seed=1)
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    gen = index.path / str(index.meta["generation"])
    records = json.loads((gen / "slides.json").read_text())
    for record in records:
        record.pop("stain"), record.pop("stain_error")
    (gen / "slides.json").write_text(json.dumps(records))
    assert build_index([slide], tmp_path / "idx", tile_size=256, level=0).slides[0].stain


def test_estimates_of_an_older_method_are_estimated_again(
    make_slide: SlideFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slide = make_slide(width=3000, height=2000, seed=1)
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    gen = index.path / str(index.meta["generation"])
    records = json.loads((gen / "slides.json").read_text())
    assert records[0]["stain"]["source"] == "level 0, 16 tiles"
    assert records[0]["stain"].pop("method") == index_stain.METHOD  # as before sampled levels
    (gen / "slides.json").write_text(json.dumps(records))
    seen: list[int] = []
    real = analyses.stain_columns
    monkeypatch.setattr(analyses, "stain_columns", lambda *a: seen.append(1) or real(*a))
    again = build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    assert seen == [1] and again.slides[0].stain == index.slides[0].stain
    build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    assert seen == [1]  # carried over once it is of the current method


def test_a_deep_pyramid_is_sampled_at_the_read_level(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """A pyramid whose mask image is its 64x level (32 um/px) is estimated from storage tiles
    of the level its tiles are read from: the overview averages nuclei into the stroma, and
    its estimate was H 18 degrees from level 0's with a third of its concentration (tiles
    normalised red)."""
    slide = make_slide(width=12000, height=10000, seed=4)
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    record = index.slides[0]
    assert record.mask_level == 3 and record.stain is not None
    assert record.stain["source"] == "level 0, 16 tiles"
    found = StainEstimate.from_json(record.stain)
    with open_slide(str(slide)) as reader:
        image, _ = read_mask_image(reader, 2048)
        mask = tissue_mask(image)
        overview = estimate_stain(image, mask)
        pixels, _ = read_tissue_sample(reader, 0, mask)
    level0 = estimate_stain(pixels)
    assert isinstance(overview, StainEstimate) and isinstance(level0, StainEstimate)
    assert angle_deg(np.array(overview.h), np.array(level0.h)) > 10  # the old estimate
    assert overview.max_c[0] < 0.5 * level0.max_c[0]
    assert angle_deg(np.array(found.h), np.array(level0.h)) < 8
    assert angle_deg(np.array(found.e), np.array(level0.e)) < 5
    assert found.max_c[0] == pytest.approx(level0.max_c[0], rel=0.15)


def test_info_json_lists_each_slides_stain(
    make_slide: SlideFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slide = make_slide(width=3000, height=2000, seed=1)
    build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    assert main(["info", str(tmp_path / "idx"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    stain = summary["slides"][0]["stain"]
    assert len(stain["H"]) == 3 and len(stain["E"]) == 3
    assert np.linalg.norm(stain["H"]) == pytest.approx(1, abs=1e-4)
    assert summary["stain"]["estimated"] == 1
    assert summary["stain"]["reference"]["H"] == stain["H"]  # the median of one slide


def test_archive_reference_is_the_median() -> None:
    def stain(h: tuple[float, float, float], l_mean: float) -> StainEstimate:
        return StainEstimate(h, (0.2, 0.8, 0.55), (2.0, 1.0), (l_mean, 20, -10), (10, 5, 5), 10)

    ref = archive_reference(
        [stain((0.6, 0.7, 0.4), 40), stain((0.7, 0.6, 0.4), 60), stain((0.5, 0.7, 0.5), 50)]
    )
    assert ref.lab_mean[0] == 50
    expected = np.array([0.6, 0.7, 0.4]) / np.linalg.norm([0.6, 0.7, 0.4])
    assert np.allclose(ref.h, expected)
    with pytest.raises(InputError, match="no slide has a stain estimate"):
        archive_reference([])


def test_reference_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    ref = StainEstimate((0.6, 0.7, 0.4), (0.2, 0.8, 0.55), (2.0, 1.0), (50, 20, -10), (10, 5, 5))
    write_reference(tmp_path / "ref.json", ref, "test")
    back = read_reference(tmp_path / "ref.json")
    assert np.allclose(back.h, ref.matrix()[:, 0] / np.linalg.norm(ref.h), atol=1e-5)
    assert back.lab_std == ref.lab_std
    (tmp_path / "bad.json").write_text('{"H": [1, 2], "E": [0, 1, 0]}')
    with pytest.raises(InputError, match="'H' must be a list of 3 numbers"):
        read_reference(tmp_path / "bad.json")
    (tmp_path / "nan.json").write_text("not json")
    with pytest.raises(InputError, match="not a JSON stain reference"):
        read_reference(tmp_path / "nan.json")
    data = json.loads((tmp_path / "ref.json").read_text())
    data["lab_std"] = [1, 0, 1]
    (tmp_path / "zero.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="positive numbers"):
        read_reference(tmp_path / "zero.json")


def test_a_malformed_stain_in_the_index_is_refused_naming_the_slide(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    slide = make_slide(width=3000, height=2000, seed=1)
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    gen = index.path / str(index.meta["generation"])
    records = json.loads((gen / "slides.json").read_text())
    records[0]["stain"]["H"] = ["x", 1, 2]
    (gen / "slides.json").write_text(json.dumps(records))
    opened = SlideIndex.open(tmp_path / "idx")  # checked where it is used
    with pytest.raises(InputError, match=r"\.svs: stain: 'H' must be a list of 3 numbers"):
        opened.summary()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"H": [1e300, 1e300, 1e300]}, "'H' has a norm of"),
        ({"E": [1e-300, 1e-300, 1e-300]}, "'E' has a norm of"),
        ({"E": "H"}, "not separable"),
        ({"H": [0.9, -0.4, 0.1]}, "negative optical density"),
        ({"max_concentrations": [1e300, 1.0]}, "'max_concentrations'"),
        ({"lab_mean": [500, 0, 0]}, "'lab_mean'"),
        ({"lab_std": [1e300, 1, 1]}, "'lab_std'"),
    ],
)
def test_stain_vectors_edited_into_an_index_are_refused(
    edit: dict[str, list[float] | str], message: str, make_slide: SlideFactory, tmp_path: Path
) -> None:
    """An index's stain is checked when read as a target file is: a norm of 1e300 (unit
    vectors of zeros after overflow), H equal to E, impossible moments."""
    slide = make_slide(width=3000, height=2000, seed=1)
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0)
    gen = index.path / str(index.meta["generation"])
    records = json.loads((gen / "slides.json").read_text())
    stain = records[0]["stain"]
    stain.update({k: stain[v] if isinstance(v, str) else v for k, v in edit.items()})
    (gen / "slides.json").write_text(json.dumps(records))
    opened = SlideIndex.open(tmp_path / "idx")
    with pytest.raises(InputError, match=message):
        opened.summary()
    reference = tmp_path / "ref.json"  # a reference file is read by the same checks
    reference.write_text(json.dumps(records[0]["stain"]))
    with pytest.raises(InputError, match=message):
        read_reference(reference)


def test_a_slide_that_is_not_h_and_e_is_said_to_be(testdata: Path, tmp_path: Path) -> None:
    """An IHC slide (kidney-48-5.tif: haematoxylin and DAB) gets an estimate and a warning
    that it fits H&E poorly, with its angles to H&E in the estimate; H&E slides do not."""
    names = ["kidney-48-5.tif", "CMU-1-Small-Region.svs", "tcga-cr-7395-01a-01-ts1.svs"]
    index = build_index([testdata / n for n in names], tmp_path / "idx", tile_size=224, level=0)
    by_name = {Path(s.path).name: s for s in index.slides}
    ihc = by_name["kidney-48-5.tif"]
    assert ihc.stain is not None and max(ihc.stain["he_deg"]) > 20
    assert "fits H&E poorly" in (ihc.warning or "")
    for name in names[1:]:
        assert "fits H&E poorly" not in (by_name[name].warning or "")
        assert max(by_name[name].stain["he_deg"]) < 20  # type: ignore[index]


# an H-DAB IHC stain: Ruifrok and Johnston's haematoxylin, and a DAB a little greener than
# theirs (0.268, 0.570, 0.776): brown still (it absorbs blue most, red least), but within the
# angle H&E slides' eosin keeps from Macenko's
H_DAB = ((0.650, 0.704, 0.286), (0.330, 0.620, 0.710))


def test_an_h_dab_slide_is_said_not_to_be_h_and_e(make_slide: SlideFactory, tmp_path: Path) -> None:
    """DAB lies 15-19 degrees from Macenko's eosin, within H&E slides' spread, but it is
    brown: it absorbs blue most and red about half as much as green, where eosin absorbs
    green and hardly any red. A synthetic H-DAB slide is said not to be H&E, and the pen
    rule flags none of its tissue (DAB is neither ink nor a blue stain)."""
    slide = make_slide(width=4000, height=3000, seed=6, stain=H_DAB)
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.5)
    record = index.slides[0]
    assert record.stain is not None and max(record.stain["he_deg"]) < 20  # angles miss it
    assert record.stain["e_lean"] < 0.35
    assert "fits H&E poorly" in (record.warning or "")
    pen = index.columns["qc_pen"]
    assert len(pen) >= 10 and (pen >= 0.1).sum() == 0


def test_h_and_e_and_ihc_test_slides_are_apart_by_eosin_s_lean(
    testdata: Path, tmp_path: Path
) -> None:
    """The E vector's lean to green (away from red) separates the real IHC slide from the
    real H&E slides by a wide margin, not just the angles (the IHC's E at 23 degrees, the
    H&E slides' within 15)."""
    names = ["kidney-48-5.tif", "CMU-1-Small-Region.svs", "tcga-cr-7395-01a-01-ts1.svs"]
    index = build_index([testdata / n for n in names], tmp_path / "idx", tile_size=224, level=0)
    lean = {Path(s.path).name: s.stain["e_lean"] for s in index.slides if s.stain}
    assert lean["kidney-48-5.tif"] < 0.2
    assert min(lean[n] for n in names[1:]) > 0.5


def test_index_and_info_summaries_say_which_slides_are_not_h_and_e(
    testdata: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Beside each slide's warning, the build's closing lines and ``info``'s stain line
    count the slides that do not look like H&E, and name them."""
    slides = [str(testdata / n) for n in ("kidney-48-5.tif", "CMU-1-Small-Region.svs")]
    out = str(tmp_path / "idx")
    main(["index", *slides, "--out", out, "--tile-size", "224", "--level", "0", "--no-progress"])
    said = capsys.readouterr().err.splitlines()
    assert any(line.startswith("stain: 1 slide not H&E") and "kidney-48-5.tif" in line
               for line in said), said  # fmt: skip
    assert main(["info", out]) == 0
    shown = capsys.readouterr().out
    assert "1 slide not H&E (kidney-48-5.tif)" in shown
    assert main(["info", out, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["stain"]["not_he"] == [slides[0]]


def test_archive_reference_leaves_out_slides_that_are_not_he(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An archive's median stain is the default normalisation target of H&E tiles: an IHC
    slide (DAB as its second stain) among them must not pull it; an archive with no H&E slide
    keeps them all, and says so."""

    def stain(h: tuple[float, float, float], e: tuple[float, float, float]) -> StainEstimate:
        return StainEstimate(h, e, (2.0, 1.0), (50, 20, -10), (10, 5, 5), 10)

    he = [stain((0.56, 0.72, 0.41), (0.22, 0.80, 0.56)) for _ in range(2)]
    dab = (0.27, 0.57, 0.78)  # DAB's OD vector: E leans to green by 0.30 < MIN_E_LEAN
    ihc = [stain((0.65, 0.70, 0.29), dab) for _ in range(3)]  # the majority, yet not H&E
    assert all(s.not_he() for s in ihc) and not any(s.not_he() for s in he)
    ref = archive_reference(he + ihc)
    assert np.allclose(ref.e, np.array(he[0].e) / np.linalg.norm(he[0].e), atol=1e-6)
    with caplog.at_level(logging.WARNING, logger="wsi_loader.index._stain_estimates"):
        only_ihc = archive_reference(ihc)
    assert np.allclose(only_ihc.e, np.array(dab) / np.linalg.norm(dab), atol=1e-6)
    assert "none of the 3 slides' stains looks like H&E" in caplog.text
