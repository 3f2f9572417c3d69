"""Indexes built with region annotations: coverage columns, tile labels, roi / exclude,
reports, errors and incremental rebuilds."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SlideFactory
from wsi_loader.errors import InputError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index import _builder as builder_module
from wsi_loader.index._slide_task import SlideTask

from .annotation_files import SHAPES, Region, annotated_archive, rect, write_geojson

GRID = {"tile_size": 256, "level": 0, "min_tissue": 0.0}


def tile(index: SlideIndex, slide_id: int, x: int, y: int) -> int:
    cols = index.columns
    hit = np.flatnonzero((cols["slide_id"] == slide_id) & (cols["l0_x"] == x) & (cols["l0_y"] == y))
    assert len(hit) == 1, (slide_id, x, y)
    return int(hit[0])


def label_of(index: SlideIndex, row: int) -> str | None:
    label = int(index.tile_labels()[row])
    return index.label_names[label] if label >= 0 else None


@pytest.fixture
def annotated(tmp_path: Path, make_slide: SlideFactory) -> Path:
    return annotated_archive(tmp_path, make_slide(width=2048, height=1536, seed=3))


@pytest.fixture
def indexed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the slides the builder indexes (reads), in order."""
    calls: list[str] = []
    real = builder_module.index_slide

    def counting(task: SlideTask) -> object:
        calls.append(Path(task.entry.path).name)
        return real(task)

    monkeypatch.setattr(builder_module, "index_slide", counting)
    return calls


def build(root: Path, out: str = "idx", **options: object) -> SlideIndex:
    return build_index(
        [root / "archive"], root / out, annotations=str(root / "annotations"), **GRID, **options
    )


def test_every_format_gives_the_same_columns_and_labels(annotated: Path) -> None:
    index = build(annotated, label_from="annotations")
    assert index.classes == ("Pen", "Stroma", "Tumor")
    assert index.label_names == ("Pen", "Stroma", "Tumor")
    assert index.coverage is not None and index.coverage.shape == (len(index), 3)
    starts = index.slide_starts()
    per_slide = [index.coverage[starts[s] : starts[s + 1]] for s in range(3)]
    np.testing.assert_array_equal(per_slide[0], per_slide[1])
    np.testing.assert_array_equal(per_slide[0], per_slide[2])
    for sid in range(3):
        assert index.coverage[tile(index, sid, 256, 256)].tolist() == [0, 0, 0.75]
        assert index.coverage[tile(index, sid, 1280, 0)].tolist() == [0, 0.5, 0]
        pen = index.coverage[tile(index, sid, 1792, 1024), 0]
        assert pen == pytest.approx(100 * 80 / 256**2)
        assert label_of(index, tile(index, sid, 0, 0)) == "Tumor"
        assert label_of(index, tile(index, sid, 1024, 256)) == "Stroma"
        assert label_of(index, tile(index, sid, 1792, 1024)) is None  # 12% Pen < 0.5
    assert (index.tile_labels() >= 0).sum() == 3 * 7
    # the slide labels stay available
    assert index.slide_label_names == () and (index.slide_labels() == -1).all()
    report = index.meta["annotations_report"]
    assert report["classes"]["Tumor"] == {"slides": 3, "tiles_labelled": 12}
    assert report["unmatched_files"] == 0 and report["slides_without_annotations"] == 0
    reopened = SlideIndex.open(annotated / "idx")
    np.testing.assert_array_equal(reopened.coverage, index.coverage)
    assert reopened.summary()["label_names"] == ["Pen", "Stroma", "Tumor"]


def test_background_label_and_min_coverage(annotated: Path) -> None:
    index = build(annotated, label_from="annotations", background_label="Other", min_coverage=0.8)
    assert index.label_names == ("Other", "Pen", "Stroma", "Tumor")
    assert label_of(index, tile(index, 0, 0, 0)) == "Other"  # Tumor covers 0.75 < 0.8
    assert label_of(index, tile(index, 0, 1024, 0)) == "Stroma"  # 1.0
    assert (index.tile_labels() >= 0).all()
    # counts of tile labels: the tiles of each class, and the slides that have any
    ids, slide_ids = index.tile_labels(), index.columns["slide_id"]
    counts = index.label_counts()
    for i, name in enumerate(index.label_names):
        mine = ids == i
        if mine.any():
            assert counts[name] == {
                "slides": len(np.unique(slide_ids[mine])), "tiles": int(mine.sum())
            }  # fmt: skip
        else:
            assert name not in counts


def test_roi_keeps_only_tiles_inside(annotated: Path) -> None:
    index = build(annotated, roi=["Tumor", "Stroma"], min_coverage=0.6)
    kept = {
        (int(x), int(y)) for x, y in zip(index.columns["l0_x"], index.columns["l0_y"], strict=True)
    }
    assert kept == {(0, 0), (256, 0), (0, 256), (256, 256), (1024, 0)}
    assert len(index) == 3 * 5
    assert not index.labels_from_annotations  # labels still come from the slides


def test_exclude_drops_tiles_overlapping_excluded_regions(annotated: Path) -> None:
    full = build(annotated)
    any_overlap = build(annotated, out="idx0", exclude=["Pen"], max_excluded=0.0)
    assert len(full) - len(any_overlap) == 3 * 2
    some = build(annotated, out="idx1", exclude=["Pen"], max_excluded=0.05)
    assert len(full) - len(some) == 3  # only the tile 12% covered goes
    labelled = build(annotated, out="idx2", exclude=["Pen"], label_from="annotations")
    assert "Pen" not in labelled.label_names


def test_a_class_named_in_an_option_but_in_no_file_is_an_error(annotated: Path) -> None:
    with pytest.raises(
        InputError,
        match=r"roi: no annotation file has the class\(es\) \['tumour'\]; the classes found "
        r"are \['Pen', 'Stroma', 'Tumor'\]",
    ):
        build(annotated, roi=["tumour"])
    assert not (annotated / "idx").exists()


def test_unmatched_files_and_slides_without_annotations_are_reported(
    annotated: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (annotated / "annotations" / "case 2.b.xml").rename(annotated / "annotations" / "other.xml")
    with caplog.at_level(logging.WARNING):
        index = build(annotated, label_from="annotations")
    report = index.meta["annotations_report"]
    assert report["unmatched_files"] == 1 and report["unmatched_examples"][0].endswith("other.xml")
    assert report["slides_without_annotations"] == 1
    assert "1 annotation files match no slide (other.xml)" in caplog.text
    assert "1 slides have no annotation file (case 2.b.svs)" in caplog.text
    starts = index.slide_starts()
    assert (index.coverage[starts[1] : starts[2]] == 0).all()


def test_a_malformed_annotation_file_fails_its_slide_with_the_reason(annotated: Path) -> None:
    path = annotated / "annotations" / "case 1.a.geojson"
    document = json.loads(path.read_text())
    document["features"][1]["geometry"]["coordinates"] = [[["x", 0], [1, 1], [2, 0]]]
    path.write_text(json.dumps(document))
    index = build(annotated)
    bad = index.slides[0]
    assert bad.status == "failed" and "feature 1: coordinates are not numbers" in (bad.error or "")
    assert str(path) in (bad.error or "")
    assert [s.status for s in index.slides[1:]] == ["ok", "ok"]


def test_a_manifest_annotations_column(annotated: Path) -> None:
    manifest = annotated / "manifest.csv"
    manifest.write_text(
        "path,annotations\n"
        '"archive/case 1.a.svs","annotations/case 1.a.geojson"\n'
        '"archive/case 2.b.svs","annotations/case 2.b.xml;annotations/case 1.a.geojson"\n'
    )
    index = build_index(
        [manifest], annotated / "m", annotations=str(manifest), label_from="annotations", **GRID
    )
    assert [len(s.annotations or []) for s in index.slides] == [1, 2]
    assert index.classes == ("Pen", "Stroma", "Tumor")


def test_an_annotations_table_written_on_windows(annotated: Path) -> None:
    table = annotated / "table.csv"
    table.write_text(
        "path,annotations\n"
        "C:\\scans\\case 1.a.svs,annotations\\case 1.a.geojson\n"
        "archive\\case 2.b.svs,annotations\\case 2.b.xml\n"
    )
    index = build_index([annotated / "archive"], annotated / "w", annotations=str(table), **GRID)
    names = [Path(a).name for s in index.slides for a in s.annotations or []]
    assert names == ["case 1.a.geojson", "case 2.b.xml"]


def test_rebuilds_reread_changed_annotations_and_relabel_without_reading(
    annotated: Path, indexed: list[str]
) -> None:
    calls = indexed
    first = build(annotated, label_from="annotations")
    assert len(calls) == 3
    calls.clear()
    again = build(annotated, label_from="annotations")
    assert calls == []
    np.testing.assert_array_equal(again.coverage, first.coverage)
    # new labelling options relabel the carried-over slides without reading them
    relabelled = build(
        annotated, label_from="annotations", background_label="Other", class_priority=["Stroma"]
    )
    assert calls == [] and (relabelled.tile_labels() >= 0).all()
    # a changed annotation file re-indexes its slide only; a new class gets a column
    write_geojson(
        annotated / "annotations" / "case 1.a.geojson",
        [*SHAPES, Region("Fat", rect(0, 1024, 256, 1280))],
    )
    changed = build(annotated, label_from="annotations")
    assert calls == ["case 1.a.svs"]
    assert changed.classes == ("Fat", "Pen", "Stroma", "Tumor")
    assert changed.coverage[tile(changed, 0, 0, 1024), 0] == 1.0
    assert changed.coverage[tile(changed, 1, 0, 1024), 0] == 0.0
    np.testing.assert_array_equal(changed.coverage[tile(changed, 2, 256, 0)], [0, 0, 0, 0.75])
    # without annotations the columns go
    calls.clear()
    plain = build_index([annotated / "archive"], annotated / "idx", **GRID)
    assert calls == [] and plain.coverage is None and not plain.classes


def test_cli_index_with_annotations_and_info_json(
    annotated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wsi_loader.cli import main

    rc = main(
        [
            "index",
            str(annotated / "archive"),
            "--out",
            str(annotated / "idx"),
            "--tile-size",
            "256",
            "--level",
            "0",
            "--min-tissue",
            "0",
            "--annotations",
            str(annotated / "annotations"),
            "--label-from",
            "annotations",
            "--min-coverage",
            "0.5",
            "--background-label",
            "Other",
            "--exclude",
            "Pen",
            "--max-excluded",
            "0",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "annotation classes: Pen (3 slides, 0 tiles labelled), Stroma" in capsys.readouterr().err
    assert main(["info", str(annotated / "idx"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["label_names"] == ["Other", "Stroma", "Tumor"]
    assert info["label_from"] == "annotations" and info["annotation_classes"] == [
        "Pen",
        "Stroma",
        "Tumor",
    ]
    assert info["tiles"] == 3 * (48 - 2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"roi": ["Tumor"]}, "roi needs annotations"),
        ({"label_from": "annotations"}, "label_from: annotations needs annotations"),
        (
            {"annotations": "x", "roi": ["A"], "exclude": ["A"]},
            "both a region of interest and excluded",
        ),
        ({"background_label": "Other"}, "background_label applies to label_from: annotations"),
        ({"annotations": "x", "min_coverage": 0}, "min_coverage"),
        # each was silently ignored without what it applies to
        ({"min_coverage": 0.3}, "min_coverage needs annotations"),
        ({"class_priority": ["Tumor"]}, "class_priority needs annotations"),
        ({"annotations": "x", "max_excluded": 0.2}, "max_excluded applies to exclude"),
    ],
)
def test_option_errors(tmp_path: Path, options: dict[str, object], message: str) -> None:
    from wsi_loader.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_index([tmp_path], tmp_path / "idx", **options)


def test_a_missing_annotations_path_is_an_error(annotated: Path) -> None:
    with pytest.raises(InputError, match="the annotations path does not exist"):
        build_index(
            [annotated / "archive"], annotated / "idx", annotations=str(annotated / "nope"), **GRID
        )


def test_annotations_that_match_no_slide_are_an_error_not_an_unlabelled_index(
    annotated: Path,
) -> None:
    """An annotation share that is mounted but empty (or holds only other slides' files) would
    rebuild every tile as background with exit 0: refused before anything is written."""
    index = build(annotated, label_from="annotations")
    before = (annotated / "idx" / "CURRENT").read_text()
    labels = index.tile_labels().copy()
    empty = annotated / "empty share"
    empty.mkdir()
    with pytest.raises(InputError, match="no annotation file matches any slide") as caught:
        build_index(
            [annotated / "archive"], annotated / "idx", annotations=str(empty),
            label_from="annotations", **GRID,
        )  # fmt: skip
    assert "empty share" in str(caught.value)
    others = annotated / "others"
    others.mkdir()
    (annotated / "annotations" / "case 2.b.xml").rename(others / "unrelated.xml")
    with pytest.raises(InputError, match=r"1 annotation file.*unrelated\.xml"):
        build_index(
            [annotated / "archive"], annotated / "idx", annotations=str(others),
            label_from="annotations", **GRID,
        )  # fmt: skip
    kept = SlideIndex.open(annotated / "idx")
    assert np.array_equal(kept.tile_labels(), labels)
    assert (annotated / "idx" / "CURRENT").read_text() == before


def test_classes_that_differ_only_in_case_are_said(
    annotated: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # one pathologist's 'tumor' beside another's 'Tumor': two classes, probably one meant
    write_geojson(
        annotated / "annotations" / "case 1.a.geojson",
        [*SHAPES, Region("tumor", rect(0, 1024, 256, 1280))],
    )
    with caplog.at_level(logging.WARNING):
        index = build(annotated, label_from="annotations")
    assert index.classes == ("Pen", "Stroma", "Tumor", "tumor")
    assert "annotation classes that differ only in case or spacing: 'Tumor' / 'tumor'" in (
        caplog.text
    )


def test_annotation_objects_choose_the_qupath_objects_that_are_regions(
    annotated: Path,
    indexed: list[str],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from wsi_loader.cli import main
    from wsi_loader.view import SlideOverview

    # an export of all objects: the annotations, and cell detections of a class of their own
    path = annotated / "annotations" / "case 1.a.geojson"
    doc = json.loads(path.read_text())
    cell = json.loads(json.dumps(doc["features"][0]))
    cell["geometry"]["coordinates"] = [[[1000, 1000], [1100, 1000], [1100, 1100], [1000, 1000]]]
    cell["properties"] = {"objectType": "cell", "classification": {"name": "Immune cells"}}
    doc["features"].append(cell)
    path.write_text(json.dumps(doc))
    args = ["index", str(annotated / "archive"), "--out", str(annotated / "idx")]
    args += ["--tile-size", "256", "--level", "0", "--min-tissue", "0", "--no-progress"]
    args += ["--annotations", str(annotated / "annotations"), "--label-from", "annotations"]
    assert main(args) == 0
    assert "case 1.a.geojson: 1 cell QuPath objects were read as regions" in caplog.text
    everything = SlideIndex.open(annotated / "idx")
    assert everything.classes == ("Immune cells", "Pen", "Stroma", "Tumor")
    assert any(name == "Immune cells" for name, _ in SlideOverview(everything, 0)._outlines())

    calls = indexed
    calls.clear()  # the build above read every slide
    caplog.clear()
    assert main([*args, "--annotation-objects", "annotation"]) == 0
    assert "case 1.a.geojson: 1 cell QuPath objects were left out" in caplog.text
    annotations_only = SlideIndex.open(annotated / "idx")
    assert len(calls) == 3  # which objects are regions changes the coverage: every slide re-read
    assert annotations_only.classes == ("Pen", "Stroma", "Tumor")
    assert annotations_only.params["annotation_objects"] == ["annotation"]
    np.testing.assert_array_equal(annotations_only.coverage, everything.coverage[:, 1:])
    # the overview draws what the index measured
    assert all(n != "Immune cells" for n, _ in SlideOverview(annotations_only, 0)._outlines())
    # a type QuPath does not have is a clear error
    from wsi_loader.errors import ConfigError

    with pytest.raises(ConfigError, match="annotation_objects"):
        build(annotated, annotation_objects=["nucleus"])
    capsys.readouterr()
    assert main([*args, "--annotation-objects", "nuclei"]) == 2
    assert "annotation_objects" in capsys.readouterr().err


def test_more_classes_in_all_than_an_index_holds_is_an_error(
    annotated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file may stay under the limit while the slides together pass it: the index's
    classes are the columns of its coverage. Nothing is written then."""
    from wsi_loader.index.annotations import _formats as formats

    monkeypatch.setattr(formats, "MAX_CLASSES", 4)  # SHAPES has 3 classes
    notes = annotated / "annotations"
    write_geojson(notes / "case 1.a.geojson", [*SHAPES, Region("Other 1", rect(0, 0, 99, 99))])
    (notes / "case 3.c.svs.xml").unlink()
    write_geojson(notes / "case 3.c.geojson", [*SHAPES, Region("Other 3", rect(0, 0, 99, 99))])
    with pytest.raises(InputError, match="5 annotation classes in all, more than the 4"):
        build(annotated)
    assert not (annotated / "idx").exists()
