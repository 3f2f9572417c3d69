"""Splits are first-class selections by slide; label mismatches are reported, never silent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SlideFactory
from wsi_loader import (
    ConfigError,
    DistributedTileSampler,
    IndexFormatError,
    InputError,
    SlideBagDataset,
    SlideIndex,
    TileDataset,
    build_index,
    make_loader,
)
from wsi_loader.cli import main
from wsi_loader.device._bench import run_bench
from wsi_loader.export import export_index


@pytest.fixture
def split_archive(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "slides"
    folder.mkdir()
    for i, seed in enumerate((41, 42, 43)):
        shutil.copy(make_slide(width=1024 + 256 * i, height=1024, seed=seed), folder / f"p{i}.svs")
    (folder / "labels.csv").write_text(
        "slide,label,split\np0,tumour,train\np1,normal,train\np2,tumour,val\n"
    )
    return folder


@pytest.fixture
def split_index(split_archive: Path, tmp_path: Path) -> SlideIndex:
    return build_index(
        [split_archive],
        tmp_path / "idx",
        tile_size=256,
        level=0,
        min_tissue=0.0,
        labels=str(split_archive / "labels.csv"),
    )


def test_a_split_is_a_view_every_reader_honours(split_index: SlideIndex, tmp_path: Path) -> None:
    path = split_index.path
    train = SlideIndex.open(path, split="train")
    val = SlideIndex.open(path, split="val")
    assert len(train) + len(val) == len(split_index)
    assert {split_index.slides[i].split for i in train.columns["slide_id"].tolist()} == {"train"}
    np.testing.assert_array_equal(
        split_index.columns["l0_x"][train.source_rows], train.columns["l0_x"]
    )
    assert "split='train'" in repr(train) and len(repr(train)) < 200
    ds = TileDataset(path, split="val")
    assert len(ds) == len(val)
    assert {int(ds[i]["slide_id"]) for i in range(len(ds))} == {2}
    rows = np.concatenate(
        [b.slide_id.numpy() for b in make_loader(path, split="train", batch_size=16, num_workers=0)]
    )
    assert len(rows) == len(train) and set(rows.tolist()) == {0, 1}
    shards = [set(DistributedTileSampler(ds, num_replicas=2, rank=r)) for r in range(2)]
    assert shards[0] | shards[1] == set(range(len(val)))
    bags = SlideBagDataset(path, k=2, split="train")
    assert len(bags) == 2 and {bags[i]["slide_id"] for i in range(2)} == {0, 1}
    report = export_index(path, tmp_path / "export", split="val", shard_size=50)
    assert report.tiles == len(val)
    manifest = (tmp_path / "export" / "manifest.csv").read_text().splitlines()[1:]
    assert {line.split(",")[3] for line in manifest} == {"2"}
    bench = run_bench(val, tiles=8, batch_size=4, workers=[0])
    assert bench["tiles"] == 8


def test_unknown_split_names_the_splits(split_index: SlideIndex) -> None:
    with pytest.raises(IndexFormatError, match=r"no slide is in split 'test'.*\['train', 'val'\]"):
        SlideIndex.open(split_index.path, split="test")
    with pytest.raises(IndexFormatError):
        TileDataset(split_index, split="test")


def test_split_on_the_command_line(
    split_index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", str(split_index.path), "--split", "val", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["split"] == "val" and [s["path"] for s in info["slides"]] == [
        split_index.slides[2].path
    ]
    assert info["tiles"] == len(SlideIndex.open(split_index.path, split="val"))
    assert info["splits"]["train"]["slides"] == 2
    out = tmp_path / "e"
    assert (
        main(
            [
                "export",
                str(split_index.path),
                "--out",
                str(out),
                "--split",
                "train",
                "--no-progress",
            ]
        )
        == 0
    )
    assert json.loads((out / "export.json").read_text())["settings"]["split"] == "train"
    assert main(["info", str(split_index.path), "--split", "nope"]) == 2


def test_one_slide_in_two_splits_is_refused(split_archive: Path, tmp_path: Path) -> None:
    shutil.copy(split_archive / "p0.svs", split_archive / "copy_of_p0.svs")
    labels = split_archive / "labels.csv"
    labels.write_text(labels.read_text() + "copy_of_p0,tumour,val\n")
    with pytest.raises(InputError, match="the same slide is in two splits"):
        build_index([split_archive], tmp_path / "idx", level=0, labels=str(labels))
    assert not (tmp_path / "idx").exists()


def test_copies_of_one_slide_are_reported(
    split_archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same scan under two names (a copy, a symlink, a second download) puts the same
    tissue in the index twice: splitting by slide id afterwards leaks it across the splits."""
    (split_archive / "again").mkdir()
    shutil.copy(split_archive / "p1.svs", split_archive / "again" / "p1 (1).svs")
    (split_archive / "again" / "link.svs").symlink_to(split_archive / "p1.svs")
    with caplog.at_level("WARNING"):
        index = build_index([split_archive], tmp_path / "idx", level=0, min_tissue=0.0)
    said = [r.getMessage() for r in caplog.records if "same contents" in r.getMessage()]
    assert len(said) == 1, said
    assert "p1.svs" in said[0] and "p1 (1).svs" in said[0] and "link.svs" in said[0]
    copies = index.summary()["copies"]
    assert [sorted(Path(p).name for p in group) for group in copies] == [
        ["link.svs", "p1 (1).svs", "p1.svs"]
    ]
    assert main(["info", str(index.path)]) == 0
    # no copies: nothing said
    caplog.clear()
    with caplog.at_level("WARNING"):
        plain = build_index([split_archive / "p0.svs"], tmp_path / "plain", level=0)
    assert plain.summary()["copies"] == [] and not caplog.records


def test_copies_line_in_info(
    split_archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(split_archive / "p2.svs", split_archive / "p2_copy.svs")
    build_index([split_archive], tmp_path / "idx", level=0, min_tissue=0.0)
    assert main(["info", str(tmp_path / "idx")]) == 0
    out = capsys.readouterr().out
    assert "copies: 1 slide has the same contents as another" in out
    assert "p2_copy.svs" in out


def test_many_copies_are_summed_up_not_listed(
    split_archive: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # an archive copied next to itself, or hard links made for a benchmark: hundreds of
    # names made one WARNING (and one info line) hundreds of paths long
    many = tmp_path / "many"
    many.mkdir()
    for i in range(40):
        (many / f"copy {i:02d}.svs").symlink_to(split_archive / "p1.svs")
    with caplog.at_level("WARNING"):
        index = build_index([many], tmp_path / "idx", level=0, min_tissue=0.0)
    said = [r.getMessage() for r in caplog.records if "same contents" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("39 slides have the same contents")
    assert "copy 00.svs = " in said[0] and "and 37 more" in said[0]
    assert "copy 39.svs" not in said[0]
    assert len(index.summary()["copies"][0]) == 40  # the data keeps them all
    assert main(["info", str(index.path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("copies:"))
    assert "and 37 more" in line and "copy 39.svs" not in line


def test_label_mismatches_are_reported_and_strict_is_an_error(
    split_archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\np0,tumour\np1,normal\nnot_a_slide,tumour\ntypo_p2,x\n")
    out = str(tmp_path / "idx")
    args = [
        "index",
        str(split_archive),
        "--out",
        out,
        "--level",
        "0",
        "--min-tissue",
        "0",
        "--labels",
        str(labels),
        "--no-progress",
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "2 labels rows match no slide (not_a_slide, typo_p2)" in err
    assert "1 slides have no label (p2.svs)" in err
    assert main(["info", out]) == 0
    assert "2 labels rows match no slide" in capsys.readouterr().out
    assert main(["info", out, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["labels_report"]
    assert report["unmatched_rows"] == 2 and report["unlabelled_slides"] == 1
    assert main([*args, "--strict-labels"]) == 2
    assert "strict_labels" in capsys.readouterr().err


def test_unlabelled_tiles_fail_early_or_are_dropped_on_request(
    split_archive: Path, tmp_path: Path
) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\np0,tumour\np1,normal\n")
    index = build_index(
        [split_archive], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(labels)
    )
    assert (TileDataset(index).slide_labels == -1).sum() == 1  # default: kept, label -1
    with pytest.raises(ConfigError, match=r"1 slides with \d+ tiles have no label.*p2.svs"):
        make_loader(index, unlabelled="raise")
    kept = TileDataset(index, unlabelled="drop")
    assert len(kept) == index.slides[0].tiles + index.slides[1].tiles
    labels_seen = {int(kept[i]["label"]) for i in range(0, len(kept), 7)}
    assert -1 not in labels_seen


def test_label_file_errors(split_archive: Path, tmp_path: Path) -> None:
    bad = tmp_path / "labels.csv"
    for text, message in (
        ("slide,label\np0,\n", "empty label"),
        (
            f"path,label\n{split_archive}/p0.svs,a\n{split_archive}/p0.svs,b\n",
            "two different labels",
        ),
    ):
        bad.write_text(text)
        with pytest.raises(InputError, match=message):
            build_index([split_archive], tmp_path / "idx", level=0, labels=str(bad))


def test_label_counts_per_split_and_a_split_missing_a_class_is_said(
    split_archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # 'val' has no 'normal' slide: its metrics cannot measure that class, and nothing said so;
    # nor did info show how the classes fall into the splits
    index = build_index(
        [split_archive], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0,
        labels=str(split_archive / "labels.csv"),
    )  # fmt: skip
    assert "split 'val' has no slide labelled 'normal' (train has 1)" in caplog.text
    starts = index.slide_starts()
    tiles = [int(starts[i + 1] - starts[i]) for i in range(3)]  # p0 tumour, p1 normal, p2 tumour
    summary = index.summary()
    assert summary["label_counts"] == {
        "normal": {"slides": 1, "tiles": tiles[1]},
        "tumour": {"slides": 2, "tiles": tiles[0] + tiles[2]},
    }
    assert summary["splits"]["train"]["labels"] == {
        "normal": {"slides": 1, "tiles": tiles[1]},
        "tumour": {"slides": 1, "tiles": tiles[0]},
    }
    assert summary["splits"]["val"]["labels"] == {"tumour": {"slides": 1, "tiles": tiles[2]}}
    val = SlideIndex.open(index.path, split="val")  # a view counts its own split
    assert val.label_counts() == {"tumour": {"slides": 1, "tiles": tiles[2]}}
    assert main(["info", str(index.path)]) == 0
    shown = capsys.readouterr().out
    assert f"classes: normal: 1 slide / {tiles[1]} tiles, tumour: 2 slides /" in shown
    assert "val 1 slides / " in shown and "(tumour: 1)" in shown
    caplog.clear()
    (split_archive / "labels.csv").write_text(
        "slide,label,split\np0,tumour,train\np1,normal,train\np2,normal,val\n"
    )
    build_index(
        [split_archive], tmp_path / "idx2", tile_size=256, level=0, min_tissue=0.0,
        labels=str(split_archive / "labels.csv"),
    )  # fmt: skip
    assert "split 'val' has no slide labelled 'tumour' (train has 1)" in caplog.text
    caplog.clear()
    (split_archive / "labels.csv").write_text("slide,label\np0,tumour\np1,normal\np2,normal\n")
    build_index(
        [split_archive], tmp_path / "idx3", tile_size=256, level=0, min_tissue=0.0,
        labels=str(split_archive / "labels.csv"),
    )  # fmt: skip
    assert "has no slide labelled" not in caplog.text  # no splits, nothing to compare


def _relabelled(archive: Path, out: Path, labels: str) -> SlideIndex:
    """The archive indexed with another labels file."""
    (archive / "labels.csv").write_text(labels)
    return build_index(
        [archive], out, tile_size=256, level=0, min_tissue=0.0, labels=str(archive / "labels.csv")
    )


def test_counts_of_numeric_labels_read_unambiguously(
    split_archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # grades as labels: 'classes: 2 2 slides / 57 tiles' and '(2 1, 10 1)' could not be read
    labels = "slide,label,split\np0,2,train\np1,10,train\np2,2,val\n"
    index = _relabelled(split_archive, tmp_path / "idx", labels)
    assert main(["info", str(index.path)]) == 0
    shown = capsys.readouterr().out
    assert "classes: 2: 2 slides / " in shown and ", 10: 1 slide / " in shown
    assert "(2: 1, 10: 1)" in shown and "(2: 1)" in shown


def test_slides_labelled_by_the_manifest_are_not_reported_unlabelled(
    split_archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest with labels and a labels file for some of its slides: the others keep the
    manifest's label. They were reported as '2 slides have no label'."""
    manifest = tmp_path / "manifest.csv"
    rows = "".join(f"{split_archive}/p{i}.svs,normal\n" for i in range(3))
    manifest.write_text("path,label\n" + rows)
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\np0,tumour\n")
    index = build_index([manifest], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(labels))
    assert [s.label for s in index.slides] == ["tumour", "normal", "normal"]
    assert "have no label" not in caplog.text
    assert index.meta["labels_report"]["unlabelled_slides"] == 0
    # a slide with no label from either is still reported
    manifest.write_text("path,label\n" + rows.replace(",normal\n", ",\n", 1))
    rebuilt = build_index([manifest], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(labels))
    assert rebuilt.meta["labels_report"]["unlabelled_slides"] == 0  # p0: from the labels file
    manifest.write_text("path,label\n" + "".join(f"{split_archive}/p{i}.svs,\n" for i in (1, 2)))
    caplog.clear()
    build_index([manifest], tmp_path / "idx2", level=0, min_tissue=0.0, labels=str(labels))
    assert "2 slides have no label (p1.svs, p2.svs)" in caplog.text


def test_a_split_view_leaves_out_slides_without_a_split(
    split_archive: Path, tmp_path: Path
) -> None:
    """A slide the labels file gives no split belongs to no split: `open(split=...)` must not
    admit it (a mutant that did survived every other test)."""
    labels = "slide,label,split\np0,tumour,train\np1,normal,\np2,tumour,val\n"
    index = _relabelled(split_archive, tmp_path / "idx", labels)
    unsplit = next(i for i, s in enumerate(index.slides) if s.path.endswith("p1.svs"))
    assert index.slides[unsplit].split is None and index.splits() == ["train", "val"]
    for split in ("train", "val"):
        view = SlideIndex.open(index.path, split=split)
        assert unsplit not in set(view.columns["slide_id"].tolist())
        assert {index.slides[i].split for i in view.columns["slide_id"].tolist()} == {split}
        assert len(TileDataset(index.path, split=split)) == len(view)
