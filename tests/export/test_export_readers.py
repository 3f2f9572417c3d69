"""Exports read by the tools people train with: WebDataset with dotted slide names, image-folder
class discovery, resume that trusts files not records, and re-export after a rebuild."""

from __future__ import annotations

import csv
import gc
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SlideFactory
from tests.vision import require
from wsi_loader import ConfigError, build_index
from wsi_loader.cli import main
from wsi_loader.export import export_index

TCGA = "TCGA-A7-A0CE-01Z-00-DX1.0F7CE5A0-4D1C.svs"


@pytest.fixture
def dotted(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(make_slide(width=1536, height=1024, seed=81), folder / TCGA)
    shutil.copy(make_slide(width=1024, height=1024, seed=82), folder / "case.v2.final.svs")
    (folder / "labels.csv").write_text(f"path,label\n{TCGA},tumour\ncase.v2.final.svs,normal\n")
    return folder


# the webdataset library leaves its shard files for the garbage collector to close
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_webdataset_reads_every_sample_of_slides_with_dots(dotted: Path, tmp_path: Path) -> None:
    import webdataset as wds

    index = build_index(
        [dotted], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(dotted / "labels.csv")
    )
    out = tmp_path / "wds"
    report = export_index(index, out, format="webdataset", image_format="jpeg", shard_size=7)
    shards = sorted(str(p) for p in out.glob("shard-*.tar"))
    dataset = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("jpg", "json", "__key__")
    samples = list(dataset)
    assert len(samples) == report.tiles == len(index)
    keys = [key for _, _, key in samples]
    assert len(set(keys)) == len(keys) and not any("." in k for k in keys)
    assert any("TCGA-A7-A0CE-01Z-00-DX1_0F7CE5A0-4D1C" in k for k in keys)  # still readable
    assert all(meta["slide"].endswith(".svs") for _, meta, _ in samples)
    del samples, dataset
    gc.collect()


def test_the_image_folder_root_holds_only_class_folders(dotted: Path, tmp_path: Path) -> None:
    index = build_index(
        [dotted], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(dotted / "labels.csv")
    )
    out = tmp_path / "folders"
    export_index(index, out, shard_size=5)
    # torchvision's ImageFolder.find_classes: every directory entry of the root is a class
    classes = sorted(entry.name for entry in os.scandir(out) if entry.is_dir())
    assert classes == ["normal", "tumour"]
    files = sorted(entry.name for entry in os.scandir(out) if entry.is_file())
    assert {"manifest.csv", "failures.csv", "export.json"} <= set(files)
    per_class = {c: len(list((out / c).iterdir())) for c in classes}
    assert sum(per_class.values()) == len(index)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".export-") and p.name != "export.json"
    }


@pytest.mark.parametrize("fmt", ["webdataset", "imagefolder"])
def test_resume_rewrites_deleted_and_truncated_outputs(
    dotted: Path, tmp_path: Path, fmt: str
) -> None:
    labels = str(dotted / "labels.csv")
    index = build_index([dotted], tmp_path / "idx", level=0, min_tissue=0.0, labels=labels)
    clean, out = tmp_path / "clean", tmp_path / "out"
    export_index(index, clean, format=fmt, shard_size=6)
    export_index(index, out, format=fmt, shard_size=6)
    outputs = sorted(p for p in out.rglob("*") if p.suffix in (".tar", ".png"))
    outputs[0].unlink()
    outputs[1].write_bytes(outputs[1].read_bytes()[:100])  # truncated
    report = export_index(index, out, format=fmt, shard_size=6)
    assert report.units - 2 <= report.units_skipped < report.units
    assert _snapshot(out) == _snapshot(clean)
    # same size, other bytes: only --verify notices
    victim = outputs[2]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert export_index(index, out, format=fmt, shard_size=6).units_skipped == report.units
    assert (
        main(
            [
                "export",
                str(index.path),
                "--out",
                str(out),
                "--format",
                fmt,
                "--shard-size",
                "6",
                "--verify",
                "--no-progress",
            ]
        )
        == 0
    )
    assert _snapshot(out) == _snapshot(clean)


def test_a_rebuild_with_the_same_tiles_resumes_and_other_tiles_need_overwrite(
    dotted: Path, tmp_path: Path
) -> None:
    out = tmp_path / "wds"
    index = build_index([dotted], tmp_path / "idx", level=0, min_tissue=0.0)
    first = export_index(index, out, format="webdataset", shard_size=6)
    os.utime(dotted / TCGA)  # a touch: the rebuild re-indexes it into a new generation
    again = build_index([dotted], tmp_path / "idx", level=0, min_tissue=0.0)
    assert again.meta["generation"] != index.meta["generation"]
    resumed = export_index(again, out, format="webdataset", shard_size=6)
    assert resumed.units_skipped == resumed.units and resumed.tiles == first.tiles
    changed = build_index(
        [dotted], tmp_path / "idx", level=0, min_tissue=0.0, tile_size=128, allow_shrink=True
    )
    with pytest.raises(ConfigError, match="--overwrite"):
        export_index(changed, out, format="webdataset", shard_size=6)
    replaced = export_index(changed, out, format="webdataset", shard_size=6, overwrite=True)
    assert replaced.tiles == len(changed) and replaced.units_skipped == 0
    assert len(list(out.glob("shard-*.tar"))) == replaced.units  # the old shards are gone


def test_shuffled_shards_mix_slides_deterministically(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    folder = tmp_path / "four"
    folder.mkdir()
    for i in range(4):
        shutil.copy(make_slide(width=1280, height=1024, seed=90 + i), folder / f"s{i}.svs")
    index = build_index([folder], tmp_path / "idx", level=0, min_tissue=0.0)
    plain = export_index(index, tmp_path / "plain", format="webdataset", shard_size=8)
    mixed = export_index(
        index, tmp_path / "mixed", format="webdataset", shard_size=8, shuffle=True, seed=3
    )
    export_index(index, tmp_path / "again", format="webdataset", shard_size=8, shuffle=True, seed=3)
    export_index(index, tmp_path / "other", format="webdataset", shard_size=8, shuffle=True, seed=4)
    assert mixed.tiles == plain.tiles == len(index)
    plain_slides = [s["slides"] for s in plain.shards]
    mixed_slides = [s["slides"] for s in mixed.shards]
    assert max(plain_slides) <= 2 and sum(mixed_slides) / len(mixed_slides) >= 3
    import json

    report = json.loads((tmp_path / "mixed" / "export.json").read_text())
    assert report["slides_per_shard"]["mean"] >= 3
    for shard in mixed.shards:  # the same seed gives the same bytes
        assert (tmp_path / "mixed" / shard["file"]).read_bytes() == (
            tmp_path / "again" / shard["file"]
        ).read_bytes()
    assert (tmp_path / "mixed" / "manifest.csv").read_text() != (
        tmp_path / "other" / "manifest.csv"
    ).read_text()
    rows = [
        line.split(",")[2]
        for line in (tmp_path / "mixed" / "manifest.csv").read_text().splitlines()[1:]
    ]
    assert sorted(map(int, rows)) == list(range(len(index)))  # every tile once
    with pytest.raises(ConfigError, match="shuffle"):  # another order is another export
        export_index(index, tmp_path / "mixed", format="webdataset", shard_size=8)


def test_coords_h5_is_read_like_clam_reads_it(dotted: Path, tmp_path: Path) -> None:
    import h5py
    import numpy as np
    import openslide

    from wsi_loader import TileDataset

    index = build_index([dotted], tmp_path / "idx", level=0, min_tissue=0.0, tile_size=256)
    out = tmp_path / "coords"
    assert (
        main(
            ["export", str(index.path), "--out", str(out), "--format", "coords-h5", "--no-progress"]
        )
        == 0
    )
    files = sorted(p.name for p in out.glob("*.h5"))
    assert files == ["TCGA-A7-A0CE-01Z-00-DX1.0F7CE5A0-4D1C.h5", "case.v2.final.h5"]
    ds = TileDataset(index)
    for sid, record in enumerate(index.slides):
        slide_id = Path(record.path).stem  # CLAM: the slide file name without its extension
        with h5py.File(out / f"{slide_id}.h5", "r") as f:
            coords = f["coords"][:]
            patch_level = int(f["coords"].attrs["patch_level"])
            patch_size = int(f["coords"].attrs["patch_size"])
        rows = np.flatnonzero(index.columns["slide_id"] == sid)
        expected = np.stack([index.columns["l0_x"][rows], index.columns["l0_y"][rows]], axis=1)
        np.testing.assert_array_equal(coords, expected)
        assert (patch_level, patch_size) == (0, 256)
        with openslide.OpenSlide(str(dotted / record.path)) as slide:  # CLAM's read
            x, y = (int(v) for v in coords[3])
            clam = np.asarray(slide.read_region((x, y), patch_level, (patch_size, patch_size)))
        np.testing.assert_array_equal(clam[..., :3], ds.reader.read([rows[3]]).pixels[0])
    manifest = (out / "manifest.csv").read_text().splitlines()
    assert len(manifest) == len(index) + 1 and "coords[0]" in manifest[1]


def test_hugging_face_imagefolder_reads_the_labels(dotted: Path, tmp_path: Path) -> None:
    import datasets

    index = build_index(
        [dotted], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(dotted / "labels.csv")
    )
    export_index(index, tmp_path / "out", shard_size=5)
    ds = datasets.load_dataset(
        "imagefolder",
        data_dir=str(tmp_path / "out"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert ds.num_rows == len(index)
    assert ds.features["label"].names == ["normal", "tumour"]


def test_hugging_face_reads_the_webdataset_export_by_its_card(
    dotted: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Hugging Face's WebDataset reader types each JSON field from the first 5 samples
    # (datasets#7549): when those have no label (an unlabelled slide first, or tiles no
    # annotation covers), the first string label later failed the load ("Couldn't cast array
    # of type string to null"). The export's dataset card (README.md) states the types.
    import datasets

    (dotted / "labels.csv").write_text("path,label\ncase.v2.final.svs,normal\n")
    index = build_index(
        [dotted], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(dotted / "labels.csv")
    )
    out = tmp_path / "wds"
    export_index(index, out, format="webdataset", image_format="jpeg", shard_size=6)
    ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == len(index)
    metas = ds["json"]
    assert metas[0]["slide_label"] is None and metas[0]["label"] is None
    assert {m["slide_label"] for m in metas} == {None, "normal"}
    assert sorted(m["row"] for m in metas) == list(range(len(index)))
    assert ds[0]["jpg"].size == (256, 256)
    # a README.md put there by someone after the export is kept by the next run
    (out / "README.md").write_text("my notes\n")
    export_index(index, out, format="webdataset", image_format="jpeg", shard_size=6)
    assert (out / "README.md").read_text() == "my notes\n"
    assert "README.md" in caplog.text and "not written" in caplog.text


def test_coords_h5_keeps_names_with_spaces_and_accents(tmp_path: Path, make_slide) -> None:  # type: ignore[no-untyped-def]
    """CLAM looks for ``<slide file name without extension>.h5``: a sanitised name is a slide
    it silently never finds."""
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(make_slide(width=1024, height=1024, seed=83), folder / "Präparat Nr.2.svs")
    index = build_index([folder], tmp_path / "idx", level=0, min_tissue=0.0)
    export_index(index, tmp_path / "coords", format="coords-h5")
    slide_id = os.path.splitext("Präparat Nr.2.svs")[0]
    assert (tmp_path / "coords" / f"{slide_id}.h5").is_file()


# A file name in Latin-1 (from an old Windows share, a zip made elsewhere): Linux keeps its
# bytes, Python holds them as lone surrogates, and UTF-8 text cannot hold them as they are.
LATIN1_NAME = os.fsdecode(b"biopsie caf\xe9.svs")


@pytest.fixture
def latin1(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "slides"
    folder.mkdir()
    try:
        shutil.copy(make_slide(width=1024, height=768, seed=84), folder / LATIN1_NAME)
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    shutil.copy(make_slide(width=1024, height=768, seed=85), folder / "plain.svs")
    return folder


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_slides_whose_names_are_not_utf8_are_exported(latin1: Path, tmp_path: Path) -> None:
    import csv
    import json

    import h5py
    import webdataset as wds

    index = build_index([latin1], tmp_path / "idx", level=0, min_tissue=0.0)
    odd = str(latin1 / LATIN1_NAME)
    assert odd in {s.path for s in index.slides}
    for fmt in ("imagefolder", "webdataset", "coords-h5"):
        out = tmp_path / fmt
        # (no labels: the image folders' tiles go to a folder beside them)
        kept = tmp_path / "unlabelled" if fmt == "imagefolder" else None
        report = export_index(index, out, format=fmt, image_format="jpeg", unlabelled_out=kept)
        assert report.failed == 0
        with open(out / "manifest.csv", encoding="utf-8", errors="surrogateescape") as fh:
            rows = list(csv.DictReader(fh))
        paths = {row["slide_path"] for row in rows}
        assert odd in paths, paths  # the file's own bytes, found again by open()
        assert all(os.path.exists(p) for p in paths)
        summary = json.loads((out / "export.json").read_text(encoding="utf-8"))
        assert summary["tiles"] == len(index)
    shards = sorted(str(p) for p in (tmp_path / "webdataset").glob("shard-*.tar"))
    slides = {meta["slide"] for meta in wds.WebDataset(shards, shardshuffle=False).decode()
              .to_tuple("json").map(lambda t: t[0])}  # fmt: skip
    assert odd in slides
    h5_name = os.path.splitext(LATIN1_NAME)[0] + ".h5"
    with h5py.File(tmp_path / "coords-h5" / h5_name, "r") as h5:  # CLAM's <slide name>.h5
        assert len(h5["coords"]) == int((index.columns["slide_id"] == 0).sum())
    gc.collect()


def test_features_of_slides_whose_names_are_not_utf8(latin1: Path, tmp_path: Path) -> None:
    import h5py

    from wsi_loader.features import extract

    index = build_index([latin1], tmp_path / "idx", level=0, min_tissue=0.0)
    report = extract(index, "tests.feature_models:tiny", tmp_path / "f", workers=0)
    assert report.written == 2 and report.failed == 0
    h5_name = os.path.splitext(LATIN1_NAME)[0] + ".h5"
    with h5py.File(tmp_path / "f" / h5_name, "r") as h5:
        assert h5["features"].shape[0] == len(h5["coords"]) > 0
    assert main(["info", str(index.path)]) == 0


def test_info_prints_names_that_are_not_utf8_in_a_utf8_locale(latin1: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    index = build_index([latin1], tmp_path / "idx", level=0, min_tissue=0.0)
    env = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(
        [sys.executable, "-m", "wsi_loader.cli", "info", str(index.path)],
        check=False,
        capture_output=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert os.fsencode(latin1 / LATIN1_NAME) in done.stdout  # the name's own bytes, as ls gives


# Hugging Face's imagefolder infers splits from words in file and folder names ("train",
# "val", "test", "eval"... between separators, digits included): an export of Camelyon16's
# test_001 loaded as a "test" split of that slide's tiles alone, with no label column
CAMELYON = {"tumor_001": "tumor", "normal_001": "normal", "test_001": "normal"}


@pytest.fixture
def camelyon(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "camelyon"
    folder.mkdir()
    for seed, name in enumerate(CAMELYON, 90):
        shutil.copy(make_slide(width=1024, height=768, seed=seed), folder / f"{name}.svs")
    rows = "".join(f"{name},{label}\n" for name, label in CAMELYON.items())
    (folder / "labels.csv").write_text(f"slide,label\n{rows}")
    return folder


def hugging_face_loads(out: Path, cache: Path) -> dict[str, Any]:
    """The export read the two ways Hugging Face reads an image folder: the imagefolder
    builder on the folder (split inference from names), and the folder as a dataset (its
    card)."""
    import datasets

    return {
        "data_dir": datasets.load_dataset(
            "imagefolder", data_dir=str(out), cache_dir=str(cache / "data-dir")
        ),
        "card": datasets.load_dataset(str(out), cache_dir=str(cache / "card")),
    }


def assert_one_split_with_every_tile(
    loads: dict[str, Any], out: Path, classes: list[str], tiles: int
) -> None:
    with open(out / "manifest.csv", newline="") as fh:
        expected = sorted(classes.index(row["label"]) for row in csv.DictReader(fh))
    assert len(expected) == tiles
    for how, loaded in loads.items():
        assert list(loaded) == ["train"], how
        split = loaded["train"]
        assert split.num_rows == tiles, how
        assert split.features["label"].names == classes, how
        assert sorted(split["label"]) == expected, how


def test_hugging_face_loads_every_tile_of_slides_with_split_words_in_their_names(
    camelyon: Path, tmp_path: Path
) -> None:
    index = build_index(
        [camelyon], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(camelyon / "labels.csv")
    )
    out = tmp_path / "folders"
    report = export_index(index, out, shard_size=20)
    assert report.tiles == len(index)
    loads = hugging_face_loads(out, tmp_path / "hf")
    assert_one_split_with_every_tile(loads, out, ["normal", "tumor"], len(index))


@pytest.mark.vision
def test_torchvision_reads_slides_with_split_words_in_their_names(
    camelyon: Path, tmp_path: Path
) -> None:
    index = build_index(
        [camelyon], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(camelyon / "labels.csv")
    )
    out = tmp_path / "folders"
    export_index(index, out, shard_size=20)
    # torchvision's ImageFolder.find_classes: every directory entry of the root is a class
    assert sorted(e.name for e in os.scandir(out) if e.is_dir()) == ["normal", "tumor"]
    torchvision = require("torchvision")
    folder = torchvision.datasets.ImageFolder(str(out))
    assert folder.classes == ["normal", "tumor"] and len(folder) == len(index)


def export_real_slides(testdata: Path, tmp_path: Path) -> tuple[Path, int]:
    """The NDPI and CMU-1 of the test data, labelled, exported to image folders: the NDPI's
    name, "test3-DAPI-2-(387)", holds "test" between separators."""
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\ntest3-DAPI-2-(387),fluorescence\nCMU-1-Small-Region,he\n")
    slides = [testdata / "test3-DAPI-2-(387).ndpi", testdata / "CMU-1-Small-Region.svs"]
    index = build_index(
        slides, tmp_path / "idx", level=0, tile_size=512, min_tissue=0.0, labels=str(labels)
    )
    assert {s.status for s in index.slides} == {"ok"}
    out = tmp_path / "folders"
    report = export_index(index, out, image_format="jpeg")
    assert report.tiles == len(index) and report.failed == 0
    assert sorted(e.name for e in os.scandir(out) if e.is_dir()) == ["fluorescence", "he"]
    return out, len(index)


def test_hugging_face_loads_every_tile_of_the_real_ndpi_and_cmu1(
    testdata: Path, tmp_path: Path
) -> None:
    out, tiles = export_real_slides(testdata, tmp_path)
    loads = hugging_face_loads(out, tmp_path / "hf")
    assert_one_split_with_every_tile(loads, out, ["fluorescence", "he"], tiles)


@pytest.mark.vision
def test_torchvision_reads_the_real_ndpi_and_cmu1(testdata: Path, tmp_path: Path) -> None:
    torchvision = require("torchvision")
    out, tiles = export_real_slides(testdata, tmp_path)
    folder = torchvision.datasets.ImageFolder(str(out))
    assert folder.classes == ["fluorescence", "he"] and len(folder) == tiles


def test_a_label_hugging_face_takes_for_a_split_is_said_and_the_card_loads_it(
    camelyon: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # labels such a reader takes for a split name cannot be renamed (they are the classes):
    # the export says so, and the folder loaded as a dataset (its card) is still right
    (camelyon / "labels.csv").write_text("slide,label\ntumor_001,valid\nnormal_001,invalid\n")
    index = build_index(
        [camelyon], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(camelyon / "labels.csv")
    )
    out = tmp_path / "folders"
    report = export_index(index, out, shard_size=20)
    assert "'valid'" in caplog.text and "split" in caplog.text
    import datasets

    loaded = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "hf"))
    assert list(loaded) == ["train"] and loaded["train"].num_rows == report.tiles
    assert loaded["train"].features["label"].names == ["invalid", "valid"]


def test_one_class_still_has_a_label_column(camelyon: Path, tmp_path: Path) -> None:
    # Hugging Face adds labels only for two folders or more; the card names the classes
    (camelyon / "labels.csv").write_text("slide,label\ntumor_001,tumor\n")
    index = build_index(
        [camelyon], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(camelyon / "labels.csv")
    )
    out = tmp_path / "folders"
    report = export_index(index, out, shard_size=20)
    import datasets

    loaded = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == report.tiles
    assert loaded.features["label"].names == ["tumor"] and set(loaded["label"]) == {0}


def test_the_card_names_the_split_exported(camelyon: Path, tmp_path: Path) -> None:
    rows = "tumor_001,tumor,val\nnormal_001,normal,val\ntest_001,normal,train\n"
    (camelyon / "labels.csv").write_text(f"slide,label,split\n{rows}")
    index = build_index(
        [camelyon], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(camelyon / "labels.csv")
    )
    out = tmp_path / "folders"
    report = export_index(index, out, shard_size=20, split="val")
    import datasets

    loaded = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "hf"))
    assert list(loaded) == ["val"] and loaded["val"].num_rows == report.tiles
    assert loaded["val"].features["label"].names == ["normal", "tumor"]


def test_an_index_with_splits_exported_whole_is_laid_out_by_split(
    camelyon: Path, tmp_path: Path
) -> None:
    """Exported without --split, an index with splits put every tile in Hugging Face's
    `train` (val slides included): the image folders are DIR/<split>/<label>/, which
    Hugging Face reads split by split (by the card, and by its own inference from folder
    names) and torchvision's ImageFolder reads one split folder at a time."""
    rows = "tumor_001,tumor,train\nnormal_001,normal,val\ntest_001,normal,test\n"
    (camelyon / "labels.csv").write_text(f"slide,label,split\n{rows}")
    index = build_index(
        [camelyon], tmp_path / "idx", level=0, min_tissue=0.0, labels=str(camelyon / "labels.csv")
    )
    out = tmp_path / "folders"
    report = export_index(index, out, shard_size=20)
    assert report.tiles == len(index)
    assert sorted(e.name for e in os.scandir(out) if e.is_dir()) == ["test", "train", "val"]
    tiles = {
        split: sum(s.tiles for s in index.slides if s.split == split)
        for split in ("train", "val", "test")
    }
    with open(out / "manifest.csv", newline="") as fh:
        listed = list(csv.DictReader(fh))
    for row in listed:  # each file under its slide's split, then its label
        split, label, _ = Path(row["file"]).parts
        assert (split, label) == (row["split"], row["label"])
    # torchvision's ImageFolder on one split: its class folders only
    assert sorted(e.name for e in os.scandir(out / "train")) == ["tumor"]
    assert sorted(e.name for e in os.scandir(out / "val")) == ["normal"]
    import datasets

    card = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "hf-card"))
    assert sorted(card) == ["test", "train", "val"]
    inferred = datasets.load_dataset(
        "imagefolder", data_dir=str(out), cache_dir=str(tmp_path / "hf-dir")
    )
    assert sorted(inferred) == ["test", "train", "validation"]
    for loaded, val in ((card, "val"), (inferred, "validation")):
        assert loaded["train"].num_rows == tiles["train"]
        assert loaded[val].num_rows == tiles["val"]
        assert loaded["test"].num_rows == tiles["test"]
    assert card["val"].features["label"].names == ["normal", "tumor"]  # the index's ids
    names = card["train"].features["label"].names
    assert sorted(names[i] for i in card["train"]["label"]) == sorted(
        r["label"] for r in listed if r["split"] == "train"
    )
    again = export_index(index, out, shard_size=20)  # resumed: every unit was done
    assert again.units_skipped == again.units == report.units and again.tiles == len(index)
    # one split exported: its class folders at the top, as before
    one = export_index(index, tmp_path / "val-only", shard_size=20, split="val")
    assert sorted(e.name for e in os.scandir(tmp_path / "val-only") if e.is_dir()) == ["normal"]
    assert one.tiles == tiles["val"]
