"""Tile labels and coverage of an annotated index reach every output: samples, batches,
DataLoader workers, exports (torchvision ImageFolder, WebDataset) and the views."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import SlideFactory
from tests.index.annotation_files import annotated_archive
from tests.vision import require
from wsi_loader.dataset import TileDataset, make_loader
from wsi_loader.errors import ConfigError
from wsi_loader.export import export_index
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.view import Mosaic, SlideOverview


@pytest.fixture
def index(tmp_path: Path, make_slide: SlideFactory) -> SlideIndex:
    root = annotated_archive(tmp_path, make_slide(width=2048, height=1536, seed=3))
    (root / "labels.csv").write_text(
        "slide,label\ncase 1.a,tumour\ncase 2.b,normal\ncase 3.c,tumour\n"
    )
    return annotated_index(root, labels=str(root / "labels.csv"), background_label="Other")


def annotated_index(root: Path, **options: object) -> SlideIndex:
    """The annotated archive indexed at level 0, every tile, labels from the annotations."""
    return build_index(
        [root / "archive"],
        root / "idx",
        tile_size=256,
        level=0,
        min_tissue=0.0,
        annotations=str(root / "annotations"),
        label_from="annotations",
        **options,
    )


def test_samples_carry_the_tile_label_slide_label_and_coverage(index: SlideIndex) -> None:
    ds = TileDataset(index)
    assert ds.label_names == ("Other", "Pen", "Stroma", "Tumor")
    assert ds.slide_label_names == ("normal", "tumour")
    row = int(np.flatnonzero(index.coverage[:, 2] == 0.75)[0])  # a Tumor tile
    sample = ds[row]
    assert sample["label"] == ds.label_names.index("Tumor")
    assert sample["slide_label"] == ds.slide_label_names.index(
        index.slides[sample["slide_id"]].label
    )
    assert sample["coverage"].dtype == torch.float32
    assert sample["coverage"].tolist() == [0.0, 0.0, 0.75]
    batch = ds.read_batch(list(range(8)))
    assert batch.coverage is not None and batch.coverage.shape == (8, 3)
    np.testing.assert_array_equal(batch.coverage.numpy(), index.coverage[:8])
    np.testing.assert_array_equal(batch.label.numpy(), index.tile_labels()[:8])
    assert set(batch.as_dict()) >= {"label", "slide_label", "coverage"}


@pytest.mark.parametrize("workers", [0, 2])
def test_make_loader_batches_carry_them_through_workers(index: SlideIndex, workers: int) -> None:
    loader = make_loader(
        index, batch_size=16, num_workers=workers, multiprocessing_context="spawn", shuffle=False
    )
    labels, coverage, slide_labels = [], [], []
    for batch in loader:
        labels.append(batch.label.numpy())
        coverage.append(batch.coverage.numpy())
        slide_labels.append(batch.slide_label.numpy())
    np.testing.assert_array_equal(np.concatenate(labels), index.tile_labels())
    np.testing.assert_array_equal(np.concatenate(coverage), index.coverage)
    expected = index.slide_labels()[index.columns["slide_id"]]
    np.testing.assert_array_equal(np.concatenate(slide_labels), expected)


def test_unlabelled_tiles_can_be_dropped_or_refused(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    root = annotated_archive(tmp_path, make_slide(width=2048, height=1536, seed=3))
    index = annotated_index(root)
    assert TileDataset(index)[len(index) - 1]["label"] == -1  # 3% Pen, no class
    assert len(TileDataset(index, unlabelled="drop")) == 3 * 7
    with pytest.raises(ConfigError, match=r"123 of 144 tiles have no annotated class"):
        TileDataset(index, unlabelled="raise")


@pytest.mark.vision
def test_image_folders_by_tile_label_read_by_torchvision(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "folders"
    report = export_index(index, out, shard_size=50)
    assert report.tiles == len(index)
    classes = sorted(entry.name for entry in os.scandir(out) if entry.is_dir())
    assert classes == ["Other", "Stroma", "Tumor"]  # Pen labels no tile
    assert len(list((out / "Tumor").iterdir())) == 12
    manifest = (out / "manifest.csv").read_text().splitlines()
    header = manifest[0].split(",")
    assert "slide_label" in header
    rows = [dict(zip(header, line.split(","), strict=True)) for line in manifest[1:]]
    tumour = [r for r in rows if r["label"] == "Tumor"]
    assert len(tumour) == 12 and all(r["file"].startswith("Tumor/") for r in tumour)
    assert {r["slide_label"] for r in tumour} == {"tumour", "normal"}
    torchvision = require("torchvision")
    folder = torchvision.datasets.ImageFolder(str(out))
    assert folder.classes == classes and len(folder) == len(index)


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_webdataset_samples_carry_label_and_coverage(index: SlideIndex, tmp_path: Path) -> None:
    import webdataset as wds

    out = tmp_path / "wds"
    export_index(index, out, format="webdataset", image_format="jpeg", shard_size=40)
    shards = sorted(str(p) for p in out.glob("shard-*.tar"))
    samples = list(wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("json"))
    metas = [meta for (meta,) in samples]
    assert len(metas) == len(index)
    by_row = {m["row"]: m for m in metas}
    for row in (0, int(np.flatnonzero(index.coverage[:, 1] > 0)[0])):
        meta = by_row[row]
        assert meta["label_id"] == int(index.tile_labels()[row])
        assert meta["label"] == index.label_names[meta["label_id"]]
        assert meta["coverage"] == pytest.approx(
            dict(zip(index.classes, index.coverage[row].tolist(), strict=True))
        )
    del samples
    gc.collect()


def test_overview_draws_outlines_and_colours_by_annotation(index: SlideIndex) -> None:
    view = SlideOverview(index, "case 2.b", color_by="annotation", max_size=256)
    drawn = sorted({name for name, _ in view.outlines})
    assert drawn == ["Pen", "Stroma", "Tumor"]
    # the Tumor outline has its hole: an exterior and an interior ring
    assert sum(name == "Tumor" for name, _ in view.outlines) == 2
    classes = [index.classes[c.annotation] if c.annotation >= 0 else None for c in view.cells]
    assert classes.count("Tumor") == 4 and classes.count("Pen") == 2
    legend = dict((text.split(" (")[0], colour) for colour, text in view._legend_entries())
    assert {"Tumor", "Stroma", "Pen", "no annotation"} <= set(legend)
    labels = SlideOverview(index, 0, color_by="label", max_size=256)
    texts = [text for _, text in labels._legend_entries()]
    assert "Tumor (4)" in texts and "Stroma (3)" in texts and "Other (41)" in texts


def test_plain_index_refuses_annotation_colouring(tmp_path: Path, make_slide: SlideFactory) -> None:
    plain = build_index([make_slide(width=1024, height=1024, seed=3)], tmp_path / "p", level=0)
    with pytest.raises(ValueError, match="needs an index built with annotations"):
        SlideOverview(plain, 0, color_by="annotation")


def test_mosaic_of_a_tile_label(index: SlideIndex) -> None:
    mosaic = Mosaic(index, 9, label="Stroma", tile_px=32)
    assert len(mosaic.rows) == 9
    assert (index.tile_labels()[mosaic.rows] == index.label_names.index("Stroma")).all()


def test_cli_mosaic_and_inspect_with_annotations(index: SlideIndex, tmp_path: Path) -> None:
    from wsi_loader.cli import main

    out = tmp_path / "m.png"
    assert main(["mosaic", str(index.path), "--out", str(out), "--n", "4", "--label", "Tumor"]) == 0
    assert main(["inspect", str(index.path), "--out", str(out), "--color-by", "annotation"]) == 0
    assert json.loads(json.dumps(index.summary()["annotation_classes"])) == [
        "Pen",
        "Stroma",
        "Tumor",
    ]
