"""Quality control at index time: columns, rules, filters, costs, and validation against
synthetic slides whose artefacts are painted with known masks."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage, stats

from tests.conftest import SlideFactory
from wsi_loader.cli.main import main
from wsi_loader.index import SlideIndex, build_index, qc_filter
from wsi_loader.index import _qc as qc
from wsi_loader.index._lowres import TileBoxes, box_means
from wsi_loader.index._qc_pixels import (
    BLUE_PEN,
    GREEN_PEN,
    RED_INK_HUE,
    RED_PEN,
    folded,
    pen_ink,
)
from wsi_loader.slides import open_slide
from wsi_loader.synthetic import SlideSpec, tissue_of, with_qc_artefacts
from wsi_loader.synthetic._artefacts import score, truth_shares

# 10k x 7.5k at 0.5 um/px: lowest level 1/16, so QC works on an 8 um/px picture; seed 4
# places two pen strokes, a blurred region, two folds and two bubbles on its tissue
QC_SPEC = with_qc_artefacts(SlideSpec(width=10_000, height=7_500, seed=4), scale=0.8)


@pytest.fixture(scope="module")
def qc_index(make_slide: SlideFactory, tmp_path_factory: pytest.TempPathFactory) -> SlideIndex:
    path = make_slide(width=10_000, height=7_500, seed=4, artefacts=QC_SPEC.artefacts)
    return build_index([path], tmp_path_factory.mktemp("qc") / "idx", tile_size=256, mpp=0.5)


def truth_of(index: SlideIndex, spec: SlideSpec = QC_SPEC) -> dict[str, np.ndarray]:
    cols = index.columns
    return truth_shares(
        spec.artefacts,
        tissue_of(spec),
        (spec.width, spec.height),
        np.asarray(cols["l0_x"], dtype=np.int64),
        np.asarray(cols["l0_y"], dtype=np.int64),
        256.0,
    )


def test_every_rule_finds_its_painted_artefacts(qc_index: SlideIndex) -> None:
    truth = truth_of(qc_index)
    flagged = qc.flags(qc_index.columns)
    for rule in qc.RULES:
        found = score(rule, flagged[rule], truth)
        assert found.positives >= 3, (rule, found)  # the slide has this artefact on tissue
        assert found.precision >= 0.9, (rule, found)
        assert found.recall >= 0.9, (rule, found)


def test_focus_orders_tiles_as_the_laplacian_of_decoded_tiles_does(qc_index: SlideIndex) -> None:
    """qc_focus comes from stored JPEG sizes, nothing decoded; blurred tiles rank low on it
    as on the variance of the Laplacian of the decoded level-0 tiles."""
    truth = truth_of(qc_index)
    cols = qc_index.columns
    rows = np.flatnonzero(np.isfinite(cols["qc_focus"]) & (truth["pen"] < 0.02))
    with open_slide(qc_index.slide_path(0)) as reader:
        lap = np.array(
            [
                ndimage.laplace(
                    reader.read_region(int(cols["l0_x"][r]), int(cols["l0_y"][r]), 0, 256, 256)
                    .astype(np.float32)
                    .mean(axis=-1)
                ).var()
                for r in rows
            ]
        )
    focus = cols["qc_focus"][rows]
    assert stats.spearmanr(focus, lap).statistic > 0.4  # content varies too, in both
    blurred, sharp = truth["blur"][rows] >= 0.5, truth["blur"][rows] < 0.02
    assert blurred.sum() >= 10
    # both put blurred tiles below sharp ones (AUC: the share of pairs ordered so)
    for measure in (focus, lap):
        pairs = measure[blurred][:, None] < measure[sharp][None, :]
        assert pairs.mean() > 0.95
    assert np.median(focus[blurred]) < 0.5 < np.median(focus[sharp])


def test_columns_are_in_the_index_and_in_range(qc_index: SlideIndex) -> None:
    for name in qc.QC_COLUMNS:
        assert qc_index.columns[name].dtype == np.float32
    for name in ("qc_pen", "qc_fold", "qc_bubble", "qc_background"):
        values = qc_index.columns[name]
        assert np.nanmin(values) >= 0 and np.nanmax(values) <= 1
    record = qc_index.slides[0]
    assert record.tissue_detector == "brightfield"
    assert record.qc is not None and record.qc["focus_source"] == "stored bytes, level 0"
    reopened = SlideIndex.open(qc_index.path)  # read back from disk
    assert set(qc.QC_COLUMNS) <= set(reopened.columns)


def test_qc_none_measures_nothing(
    make_slide: SlideFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("quality control ran with qc none")

    monkeypatch.setattr("wsi_loader.index._analyses.measure_sharpness", refuse)
    monkeypatch.setattr("wsi_loader.index._qc.measure", refuse)
    index = build_index([make_slide(width=3000, height=2000, seed=1)], tmp_path / "i", qc="none")
    assert not set(qc.QC_COLUMNS) & set(index.columns)
    assert index.slides[0].qc is None
    assert index.summary()["qc"] is None


def test_qc_exclude_drops_flagged_tiles_and_counts_them(
    qc_index: SlideIndex, tmp_path: Path
) -> None:
    source = qc_index.slide_path(0)
    dropped = build_index([source], tmp_path / "x", tile_size=256, mpp=0.5, qc_exclude=["pen"])
    pen = qc.flags(qc_index.columns, ["pen"])["pen"]
    assert len(dropped) == len(qc_index) - int(pen.sum()) > 0
    assert dropped.slides[0].qc is not None
    assert dropped.slides[0].qc["excluded"] == {"pen": int(pen.sum()), "any": int(pen.sum())}
    assert not qc.flags(dropped.columns, ["pen"])["pen"].any()
    summary = dropped.summary()
    assert summary["qc"]["excluded"] == {"pen": int(pen.sum()), "any": int(pen.sum())}
    assert summary["slides"][0]["qc"]["pen"] == 0


def test_thresholds_change_what_rules_flag(qc_index: SlideIndex) -> None:
    strict = qc.flags(qc_index.columns, ["blur"], {"blur": 0.9})["blur"]
    lenient = qc.flags(qc_index.columns, ["blur"], {"blur": 0.2})["blur"]
    default = qc.flags(qc_index.columns, ["blur"])["blur"]
    assert lenient.sum() < default.sum() < strict.sum()
    with pytest.raises(ValueError, match="no QC rule 'smudge'"):
        qc.flags(qc_index.columns, ["smudge"])


def test_open_where_keeps_what_the_filter_keeps(qc_index: SlideIndex) -> None:
    flagged = qc.flags(qc_index.columns, ["pen", "blur"])
    expected = ~(flagged["pen"] | flagged["blur"])
    view = SlideIndex.open(qc_index.path, where=qc_filter("pen", "blur"))
    assert len(view) == int(expected.sum())
    assert view.filtered == len(qc_index) - len(view)
    assert np.array_equal(view.source_rows, np.flatnonzero(expected))
    lambda_view = SlideIndex.open(qc_index.path, where=lambda c: c["qc_pen"] < 0.1)
    assert len(lambda_view) == int((qc_index.columns["qc_pen"] < 0.1).sum())
    with pytest.raises(ValueError, match="booleans"):
        SlideIndex.open(qc_index.path, where=lambda c: c["qc_pen"])
    with pytest.raises(ValueError, match="no QC rule"):
        qc_filter("smudge")
    with pytest.raises(ValueError, match=r"no QC rule 'blurr' \(did you mean 'blur'\?\)"):
        qc_filter(blurr=0.4)


def test_cli_index_excludes_and_info_counts(qc_index: SlideIndex, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "cli"
    source = qc_index.slide_path(0)
    code = main(
        ["index", source, "--out", str(out), "--qc-exclude", "pen,blur", "--qc-threshold",
         "blur=0.4", "--no-progress"]
    )  # fmt: skip
    assert code == 0
    # "0 tiles flagged; 12 left out by --qc-exclude" read as a contradiction: what was left
    # out comes first, then what the tiles kept are flagged for
    said = re.search(
        r"quality control: (\d+) tiles? left out by --qc-exclude \(pen (\d+), blur (\d+)\); "
        r"of the (\d+) tiles kept, (\d+) (?:is|are) flagged "
        r"\(pen 0, blur 0, fold \d+, bubble \d+\)",
        capsys.readouterr().err,
    )
    assert said is not None, "the QC line"
    kept = SlideIndex.open(out)
    left_out, pen, blur, n_kept, _ = (int(g) for g in said.groups())
    assert n_kept == len(kept) and left_out > 0 and pen > 0 and blur > 0
    assert main(["info", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"{left_out} tiles left out by qc_exclude" in shown
    assert f"of the {n_kept} tiles kept" in shown
    assert main(["info", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["qc"]["thresholds"]["blur"] == 0.4
    slide = summary["slides"][0]
    assert slide["qc"]["excluded"]["pen"] > 0 and slide["qc"]["excluded"]["blur"] > 0
    assert slide["qc"]["pen"] == slide["qc"]["blur"] == 0
    assert set(slide["qc"]) == {"pen", "blur", "fold", "bubble", "any", "excluded"}
    measured = slide["qc_summary"]  # the slide-level figures beside the counts
    assert measured["focus_source"].startswith("stored bytes")  # JPEG tile sizes, no decode
    assert measured["picture"].endswith("um/px") and measured["focus_reference"] > 0
    assert measured["area_shares"]["pen"] > 0 and set(measured["area_shares"]) == {
        "pen",
        "fold",
        "bubble",
    }
    assert main(["info", str(out)]) == 0
    assert "quality control (pen >= 0.1, blur < 0.4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["index", source, "--out", str(out), "--qc-exclude", "smudge"])
    for flag, value in (("--qc-exclude", "pne"), ("--qc-threshold", "blurr=0.4")):
        with pytest.raises(SystemExit):
            main(["index", source, "--out", str(out), flag, value])
        assert "(did you mean" in capsys.readouterr().err
    assert main(["index", source, "--out", str(out), "--qc", "none", "--qc-exclude", "pen"]) == 2
    error = capsys.readouterr().err
    assert "error: command line: 'qc_exclude': drops tiles that quality control flags" in error
    assert "Value error" not in error


def test_inspect_colours_tiles_by_rule_and_mosaic_samples_flagged(
    qc_index: SlideIndex, tmp_path: Path
) -> None:
    from wsi_loader.view import QC_COLOURS, Mosaic, SlideOverview

    overview = SlideOverview(qc_index, 0, color_by="qc", max_size=400)
    drawn = {cell.qc for cell in overview.cells}
    assert {"pen", "blur", "fold"} <= drawn
    legend = dict((text.split(" ")[0], colour) for colour, text in overview._legend_entries())
    assert legend["pen"] == QC_COLOURS["pen"]
    mosaic = Mosaic(qc_index, 4, qc="fold", tile_px=32)
    fold = qc.flags(qc_index.columns, ["fold"])["fold"]
    assert fold[mosaic.rows].all()
    out = tmp_path / "q.png"
    assert main(["inspect", str(qc_index.path), "--out", str(out), "--color-by", "qc"]) == 0
    assert main(["mosaic", str(qc_index.path), "--out", str(out), "--qc", "any", "--n", "4"]) == 0


def test_an_index_without_qc_columns_is_rebuilt_with_them(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    slide = make_slide(width=3000, height=2000, seed=1)
    before = build_index([slide], tmp_path / "i", qc="none")
    assert "qc_focus" not in before.columns
    after = build_index([slide], tmp_path / "i")
    assert after.meta["build"] == {"unchanged": 0, "indexed": 1}
    assert "qc_focus" in after.columns
    again = build_index([slide], tmp_path / "i")
    assert again.meta["build"] == {"unchanged": 1, "indexed": 0}
    assert np.array_equal(again.columns["qc_pen"], after.columns["qc_pen"], equal_nan=True)


def test_a_failed_slide_does_not_drop_the_qc_columns(
    make_slide: SlideFactory, tmp_path: Path, testdata: Path
) -> None:
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "a.svs").write_bytes(make_slide(width=3000, height=2000, seed=1).read_bytes())
    (folder / "broken.svs").write_bytes((testdata / "broken.svs").read_bytes())
    index = build_index([folder], tmp_path / "i")
    assert [s.status for s in index.slides] == ["ok", "failed"]
    assert "qc_focus" in index.columns


def test_pen_table_is_histolabs_rules(tmp_path: Path) -> None:
    """The 256 x 256 lookup tables give exactly what testing every triple gives."""
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (200_000, 1, 3), dtype=np.uint8)
    r, g, b = (rgb[..., i].astype(int) for i in range(3))
    blue = np.zeros(r.shape, bool)
    green = np.zeros(r.shape, bool)
    red = np.zeros(r.shape, bool)
    for tr, tg, tb in BLUE_PEN:
        blue |= (r < tr) & (g < tg) & (b > tb)
    for tr, tg, tb in GREEN_PEN:
        green |= (r < tr) & (g > tg) & (b > tb)
    for tr, tg, tb in RED_PEN:
        red |= (r > tr) & (g < tg) & (b < tb)
    red &= 10 * (b - g) <= RED_INK_HUE * (r - g)
    black = (rgb.max(-1) <= 90) & (rgb.max(-1).astype(int) - rgb.min(-1) <= 35)
    vivid_green = (g >= r + 30) & (g >= b + 30)  # a solid green marker (no blue): ours
    assert np.array_equal(pen_ink(rgb), blue | green | red | black | vivid_green)


def test_box_means_are_exact_area_weighted_means() -> None:
    rng = np.random.default_rng(1)
    raster = rng.random((7, 9))
    # a raster pixel is 10 level-0 px; footprints 13 px wide at fractional pixel positions
    tiles = TileBoxes(np.array([0, 4, 17, 55, 80]), np.array([0, 9, 33, 2, 60]), 13.0)
    got = box_means(raster, 0.1, 0.1, tiles)
    fine = np.kron(raster, np.ones((10, 10)))  # each level-0 pixel
    for i, (x, y) in enumerate(zip(tiles.l0_x, tiles.l0_y, strict=True)):
        part = fine[y : y + 13, x : x + 13]
        assert got[i] == pytest.approx(part.mean(), rel=1e-5)


def test_config_checks_qc_options() -> None:
    from wsi_loader.config import QC_RULES, IndexConfig

    assert tuple(qc.RULES) == QC_RULES
    with pytest.raises(ValueError, match="no QC rule 'smudge'"):
        IndexConfig(qc_thresholds={"smudge": 0.1})
    with pytest.raises(ValueError, match="between 0 and 1"):
        IndexConfig(qc_thresholds={"pen": 2.0})
    with pytest.raises(ValueError, match="quality control is off"):
        IndexConfig(qc="none", qc_exclude=["pen"])


@pytest.mark.testdata
def test_no_tissue_tile_of_cmu1_is_flagged_blurred(testdata: Path, tmp_path: Path) -> None:
    index = build_index([testdata / "CMU-1-Small-Region.svs"], tmp_path / "i", mpp=0.5)
    assert len(index) > 20
    assert not qc.flags(index.columns, ["blur"])["blur"].any()
    assert np.nanmin(index.columns["qc_focus"]) > 0.6


def test_new_thresholds_without_exclusion_recount_without_reading(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    slide = make_slide(width=3000, height=2000, seed=1)
    build_index([slide], tmp_path / "i", qc_thresholds={"blur": 0.4})
    again = build_index([slide], tmp_path / "i", qc_thresholds={"blur": 0.6})
    assert again.meta["build"] == {"unchanged": 1, "indexed": 0}
    assert again.summary()["qc"]["thresholds"]["blur"] == 0.6
    excluding = build_index(
        [slide], tmp_path / "i", qc_thresholds={"blur": 0.6}, qc_exclude=["pen"]
    )
    assert excluding.meta["build"] == {"unchanged": 0, "indexed": 1}  # tiles may go


def test_a_malformed_qc_summary_in_slides_json_is_ignored(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    index = build_index([make_slide(width=3000, height=2000, seed=1)], tmp_path / "i")
    slides_json = index.path / str(index.meta["generation"]) / "slides.json"
    records = json.loads(slides_json.read_text())
    records[0]["qc"] = {
        "excluded": {"pen": "many", "smudge": 3, "blur": 2},
        "focus_source": ["not", "text"],
        "focus_reference": 1.5,
        "area_shares": {"pen": 0.1, "fold": "lots", "smudge": 0.2},
    }
    slides_json.write_text(json.dumps(records))
    summary = SlideIndex.open(index.path).summary()
    assert summary["slides"][0]["qc"]["excluded"] == {"blur": 2}
    assert summary["slides"][0]["qc_summary"] == {
        "focus_reference": 1.5,
        "area_shares": {"pen": 0.1},
    }
    records[0]["qc"] = 5
    slides_json.write_text(json.dumps(records))
    summary = SlideIndex.open(index.path).summary()
    assert summary["slides"][0]["qc"]["excluded"] == {}
    assert summary["slides"][0]["qc_summary"] is None


def test_flags_and_filters_go_by_the_index_s_own_thresholds(
    qc_index: SlideIndex, tmp_path: Path
) -> None:
    # qc.flags(index.columns) and qc_filter() used the default thresholds while info and
    # inspect used the index's own: a strict index dropped fewer tiles than info counted
    strict = build_index(
        [qc_index.slide_path(0)], tmp_path / "i", tile_size=256, mpp=0.5,
        qc_thresholds={"blur": 0.9},
    )  # fmt: skip
    at_build = qc.flags(strict.columns, ["blur"], {"blur": 0.9})["blur"]
    at_default = qc.flags(strict.columns, ["blur"])["blur"]  # columns alone: the defaults
    assert at_default.sum() < at_build.sum()
    assert np.array_equal(qc.flags(strict, ["blur"])["blur"], at_build)  # the index: its own
    assert np.array_equal(qc.flags(strict, ["blur"], {"blur": 0.5})["blur"], at_default)
    counted = strict.summary()["qc"]["flagged"]["blur"]
    assert counted == int(at_build.sum())
    view = SlideIndex.open(strict.path, where=qc_filter("blur"))
    assert len(view) == len(strict) - counted  # what info counts is what the filter drops
    given = SlideIndex.open(strict.path, where=qc_filter("blur", blur=0.5))
    assert len(given) == len(strict) - int(at_default.sum())
    alone = qc_filter("blur")(strict.columns)  # called on columns: the defaults
    assert np.array_equal(alone, ~at_default)


@pytest.mark.parametrize("name", sorted(qc.RULES))
def test_a_value_on_the_threshold_is_flagged_as_the_rule_says(name: str) -> None:
    """``pen``, ``fold``, ``bubble`` flag a share at or above their threshold, ``blur`` a
    focus below it: a value exactly on the threshold is flagged by the first three only."""
    rule = qc.RULES[name]
    values = np.array([np.nextafter(rule.threshold, -1), rule.threshold,
                       np.nextafter(rule.threshold, 2), np.nan], np.float64)  # fmt: skip
    expected = [True, False, False, False] if rule.below else [False, True, True, False]
    assert qc.flags({rule.column: values}, [name])[name].tolist() == expected
    assert rule.flags(values).tolist() == expected


@pytest.mark.parametrize("colour", [(0, 128, 0), (0, 200, 0), (20, 160, 40), (0, 0, 255)])
def test_a_solid_marker_colour_is_ink(colour: tuple[int, int, int]) -> None:
    """Saturated green (no blue at all) is ink as solid blue is: histolab's green triples
    ask for some blue."""
    assert pen_ink(np.full((4, 4, 3), colour, np.uint8)).all()


def test_a_blue_stained_slide_is_not_all_pen(make_slide: SlideFactory, tmp_path: Path) -> None:
    """A Giemsa-like slide (tissue in blues: methylene blue / azure where H&E has
    haematoxylin, little eosin) is not flagged pen over its tissue, and its warning says
    blue was taken as the stain."""
    giemsa = ((0.80, 0.55, 0.22), (0.2159, 0.8012, 0.5581))
    slide = make_slide(width=3000, height=2400, seed=8, stain=giemsa, amounts=(2.5, 0.3))
    index = build_index([slide], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.5)
    cols = index.columns
    assert len(cols["qc_pen"]) >= 10
    assert (cols["qc_pen"] < 0.1).mean() > 0.9
    assert "taken as the stain" in (index.slides[0].warning or "")


def test_rules_find_artefacts_of_a_painter_they_were_not_tuned_on(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """The same layout painted by `synthetic._other_artefacts` (ink blended over the stain
    at 75%, a fold as a second tissue layer): pen and fold keep recall and precision of at
    least 0.8 over the tiles half covered, pen for every ink colour."""
    path = make_slide(width=10_000, height=7_500, seed=4, artefacts=QC_SPEC.artefacts,
                      artefact_painter="other")  # fmt: skip
    index = build_index([path], tmp_path / "idx", tile_size=256, mpp=0.5)
    truth = truth_of(index)
    flagged = qc.flags(index.columns)
    for rule in ("pen", "fold"):
        found = score(rule, flagged[rule], truth)
        assert found.positives >= 5 and found.recall >= 0.8, (rule, found)
        assert found.precision >= 0.8, (rule, found)
    inks = 0
    for ink in ("blue", "green", "black", "red"):
        strokes = tuple(a for a in QC_SPEC.artefacts if getattr(a, "ink", None) == ink)
        positive = truth_of(index, replace(QC_SPEC, artefacts=strokes))["pen"] >= 0.5
        if positive.any():
            inks += 1
            assert flagged["pen"][positive].mean() >= 0.8, ink
    assert inks >= 2
    # ink over the tissue is no reason to call the slide's stain other than H&E
    assert "fits H&E poorly" not in (index.slides[0].warning or "")


@pytest.mark.parametrize("painter", ["ours", "other"])
def test_folds_are_found_beside_denser_tissue_of_another_colour(
    painter: str, make_slide: SlideFactory, tmp_path: Path
) -> None:
    """On a slide stained by Beer-Lambert (Macenko's vectors: cellular cores of dense
    haematoxylin beside paler eosin stroma), a fold over the stroma is twice the stroma's
    density but not much denser than the tissue around, cores included: folds are judged
    against the tissue of their own colour around them, and found (recall and precision of
    at least 0.8 over the tiles half covered)."""
    stain = ((0.5626, 0.7201, 0.4062), (0.2159, 0.8012, 0.5581))
    spec = replace(QC_SPEC, stain=stain)
    path = make_slide(width=10_000, height=7_500, seed=4, artefacts=QC_SPEC.artefacts,
                      stain=stain, artefact_painter=painter)  # fmt: skip
    index = build_index([path], tmp_path / "idx", tile_size=256, mpp=0.5)
    found = score("fold", qc.flags(index.columns)["fold"], truth_of(index, spec))
    assert found.positives >= 5 and found.recall >= 0.8, found
    assert found.precision >= 0.8, found


def test_folds_judged_by_their_own_hue_are_not_lost_where_they_fill_that_hue(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """A fold is also judged against all the tissue around, as before folds were compared
    by hue: where folded pixels are most of their hue's part around them they raise their
    own reference (the hue comparison alone found 12 of these 14 folded tiles)."""
    path = make_slide(width=10_000, height=7_500, seed=4, artefacts=QC_SPEC.artefacts,
                      artefact_painter="other")  # fmt: skip
    index = build_index([path], tmp_path / "idx", tile_size=256, mpp=0.5)
    found = score("fold", qc.flags(index.columns)["fold"], truth_of(index))
    assert found.positives >= 10 and found.recall >= 0.95, found
    assert found.precision >= 0.95, found


def _stroma_picture() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 240 x 400 picture stained by Beer-Lambert (another lab's H&E): pale eosin stroma,
    dense haematoxylin-rich tissue over its left 120 px (dense beside loose), a round
    nodule of stroma twice as dense (30 px across) and a fold: a strip of the stroma
    lying on itself (16 px wide, 160 long). Returns the picture, the fold's pixels and
    the nodule's."""
    rng = np.random.default_rng(0)
    h_vec, e_vec = np.array([0.65, 0.70, 0.29]), np.array([0.30, 0.80, 0.45])
    h_vec, e_vec = h_vec / np.linalg.norm(h_vec), e_vec / np.linalg.norm(e_vec)
    e = np.zeros((240, 400))
    hx = np.zeros((240, 400))
    e[10:230, 10:390] = 0.12
    hx[10:230, 10:130], e[10:230, 10:130] = 0.5, 0.2
    fold = np.zeros((240, 400), dtype=bool)
    fold[40:200, 200:216] = True
    yy, xx = np.mgrid[:240, :400]
    nodule = (yy - 120) ** 2 + (xx - 320) ** 2 <= 15**2
    e[fold | nodule] *= 2
    od = hx[..., None] * h_vec + e[..., None] * e_vec
    od *= 1 + 0.05 * rng.standard_normal((240, 400, 1))
    rgb = np.clip(255 * 10 ** (-od) + 0.5, 0, 255).astype(np.uint8)
    return rgb, fold, nodule


def test_a_fold_over_pale_stroma_is_a_band_a_dense_region_beside_it_is_none() -> None:
    """Pale stroma is no stained tissue: the stained tissue around a fold over it is the
    dense tissue beside it, as dense as the fold, or the fold itself. The fold is found as
    a band twice as dense as the pale tissue on both sides of it; the dense region beside
    the stroma (wider than a fold) and the nodule (no strip) are no folds."""
    rgb, fold, nodule = _stroma_picture()
    strength = np.linalg.norm(-np.log10(np.maximum(rgb, 1) / 255.0), axis=-1)
    stained, tissue = strength >= 0.18, strength >= 0.05
    ink = np.zeros(stained.shape, dtype=bool)
    found = folded(rgb, stained, ink, 64, 352, tissue=tissue, reach=80)
    assert found[fold].mean() >= 0.8
    assert not found[:, :140].any()  # the dense region and its rim
    assert not found[nodule].any()
    # the stained tissue alone as the reference, the fold is lost beside the dense region
    assert not folded(rgb, stained, ink, 64, 352)[fold].any()


def test_a_fold_over_pale_stroma_is_found_where_it_runs_on_along_dense_tissue() -> None:
    """A fold over the pale stroma (as in `_stroma_picture`) that leaves the open stroma and
    runs on along the dense tissue's edge, down to the section's edge, has pale tissue on
    one side only there: the band found in the open stroma is followed along the fold (the
    area denser than its hue's pale tissue joined to it, itself a band; the rule before
    found 40% of it). The dense tissue and its rim stay no fold."""
    h_vec, e_vec = np.array([0.65, 0.70, 0.29]), np.array([0.30, 0.80, 0.45])
    h_vec, e_vec = h_vec / np.linalg.norm(h_vec), e_vec / np.linalg.norm(e_vec)
    fold = np.zeros((240, 400), dtype=bool)
    fold[60:76, 146:300] = True  # in the open stroma: pale above and below
    fold[60:230, 130:146] = True  # along the dense tissue, down to the section's edge
    e = np.where(fold, 0.24, 0.12)
    e[230:] = 0.0
    e[:10], e[:, :10], e[:, 390:] = 0.0, 0.0, 0.0
    hx = np.zeros(e.shape)
    hx[10:230, 10:130], e[10:230, 10:130] = 0.5, 0.2
    od = hx[..., None] * h_vec + e[..., None] * e_vec
    od *= 1 + 0.05 * np.random.default_rng(1).standard_normal((*e.shape, 1))
    rgb = np.clip(255 * 10 ** (-od) + 0.5, 0, 255).astype(np.uint8)
    strength = np.linalg.norm(-np.log10(np.maximum(rgb, 1) / 255.0), axis=-1)
    stained, tissue = strength >= 0.18, strength >= 0.05
    ink = np.zeros(stained.shape, dtype=bool)
    found = folded(rgb, stained, ink, 64, 352, tissue=tissue, reach=80)
    assert found[fold].mean() >= 0.8
    assert found[120:230, 130:146].mean() >= 0.8  # the part with pale tissue on one side
    assert not found[:, :128].any()  # the dense region and its rim
    assert found[~ndimage.binary_dilation(fold, iterations=2)].sum() <= 20


@pytest.mark.parametrize("painter", ["ours", "other"])
def test_folds_over_pale_stroma_are_found_on_a_dark_h_pale_e_staining(
    painter: str, make_slide: SlideFactory, tmp_path: Path
) -> None:
    """Stained by another lab's H&E, haematoxylin x1.4 and eosin x0.7: the stroma is too pale
    to count as stained, so the stained tissue around a fold over it is the dense cellular
    tissue beside it (or the fold itself), as dense as the fold. Folds over the stroma are
    found as bands (`folded`): precision of at least 0.8 and recall of at least 0.75 over
    the tiles half covered (12 and 11 of 14 tiles, our painter and the other; the rule
    before found 3 and 0). A fold along the dense tissue's edge has it on one side: no band."""
    stain, amounts = ((0.65, 0.70, 0.29), (0.30, 0.80, 0.45)), (1.4, 0.7)
    spec = replace(QC_SPEC, stain=stain, amounts=amounts)
    path = make_slide(width=10_000, height=7_500, seed=4, artefacts=QC_SPEC.artefacts,
                      stain=stain, amounts=amounts, artefact_painter=painter)  # fmt: skip
    index = build_index([path], tmp_path / "idx", tile_size=256, mpp=0.5)
    found = score("fold", qc.flags(index.columns)["fold"], truth_of(index, spec))
    assert found.positives >= 10 and found.recall >= 0.75, found
    assert found.precision >= 0.8, found
