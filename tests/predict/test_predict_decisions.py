"""What `predict` decides and writes beyond the probabilities: a one-output model's calls
follow the threshold, models whose outputs are maps are refused, text cells of slides.csv are
never spreadsheet formulas, tile boxes off level 0, the GeoJSON in WSInfer's layout."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SlideFactory
from wsi_loader.cli import main
from wsi_loader.files import csv_text
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.predict._outputs import TilePredictions


def run_predict(index: SlideIndex | Path, out: Path, *options: str) -> int:
    path = index.path if isinstance(index, SlideIndex) else index
    return main(["predict", str(path), "--out", str(out), "--workers", "0", "--no-progress",
                 *options])  # fmt: skip


def slides_csv(out: Path) -> list[dict[str, str]]:
    with open(out / "slides.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def geojson_classes(out: Path, stem: str) -> list[str | None]:
    document = json.loads((out / "model-outputs-geojson" / f"{stem}.json").read_text())
    return [(f["properties"].get("classification") or {}).get("name") for f in document["features"]]


def test_a_one_output_model_is_decided_by_the_threshold(index: SlideIndex, tmp_path: Path) -> None:
    """Every tile's probability is about 0.0067: argmax over one class called each slide and
    each tile "tumour"."""
    model = ["--model", "tests.feature_models:one_output", "--no-heatmaps"]
    assert run_predict(index, tmp_path / "default", *model) == 0
    for row in slides_csv(tmp_path / "default"):
        assert float(row["mean_tumour"]) < 0.01
        assert row["predicted"] == ""  # below 0.5: not tumour
        assert set(geojson_classes(tmp_path / "default", row["name"])) == {None}
    assert run_predict(index, tmp_path / "low", *model, "--threshold", "0.005") == 0
    for row in slides_csv(tmp_path / "low"):
        assert row["predicted"] == "tumour"
        assert set(geojson_classes(tmp_path / "low", row["name"])) == {"tumour"}
    run = json.loads((tmp_path / "low" / "predict.json").read_text())
    assert run["activation"] == "sigmoid" and ">= 0.005" in run["slide_rule"]["predicted"]


def test_a_one_output_models_metrics_count_the_other_label_as_its_negatives(
    index: SlideIndex, tmp_path: Path
) -> None:
    """Labels normal/tumour and a one-output "tumour" model (the only way to give a sigmoid
    classifier): the normal slide was left out of metrics.json (n=1, no ROC AUC: "needs items
    of this class and of others") although it is exactly the model's negative."""
    out = tmp_path / "p"
    assert run_predict(index, out, "--model", "tests.feature_models:one_output",
                       "--no-heatmaps") == 0  # fmt: skip
    slides = json.loads((out / "metrics.json").read_text())["slides"]
    assert slides["n"] == 2 and slides["support"] == {"tumour": 1}
    assert slides["roc_auc"]["tumour"]["auc"] is not None
    assert slides["per_class_balanced_accuracy"] == {"tumour": 0.5}  # both called negative


@pytest.mark.parametrize(("model", "code"), [("map_output", 2), ("map_output_1x1", 0)])
def test_a_model_returning_a_map_per_tile_is_refused(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, code: int
) -> None:
    """(B, C, H, W) was flattened into C*H*W softmaxed "classes"; (B, C, 1, 1) is C values."""
    out = tmp_path / "p"
    assert run_predict(index, out, "--model", f"tests.feature_models:{model}",
                       "--no-heatmaps") == code  # fmt: skip
    err = capsys.readouterr().err
    if code:
        assert "(1, 2, 4, 4)" in err and "not a map per tile" in err, err
        assert not (out / "model-outputs-csv").is_dir() or not any(
            (out / "model-outputs-csv").iterdir()
        )
    else:
        tiles = TilePredictions.read_csv(next((out / "model-outputs-csv").iterdir()))
        assert tiles.probabilities.shape[1] == 2


def test_a_slide_named_as_a_formula_is_text_in_slides_csv(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    """A spreadsheet runs a cell starting with = + - @ (OWASP's CSV injection): text cells get
    a leading quote, numbers stay numbers, and our reader (`csv_text`) gives the name back."""
    folder = tmp_path / "slides"
    folder.mkdir()
    names = ["=cmd|calc!A0", "+1", "@sum", "'quoted", "plain"]
    for name in names:
        shutil.copy(make_slide(width=1024, height=768, seed=5), folder / f"{name}.svs")
    index = build_index([folder], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0)
    out = tmp_path / "p"
    assert run_predict(index, out, "--model", "tests.feature_models:classifier",
                       "--no-heatmaps") == 0  # fmt: skip
    text = (out / "slides.csv").read_text()
    assert "\n'=cmd|calc!A0" not in text  # the path column starts with the folder
    rows = slides_csv(out)
    by_name = {row["name"]: row for row in rows}
    assert set(by_name) == {"'=cmd|calc!A0", "'+1", "'@sum", "''quoted", "plain"}
    assert sorted(csv_text(row["name"]) for row in rows) == sorted(names)
    assert all(float(row["tiles"]) > 0 and float(row["mean_normal"]) >= 0 for row in rows)


def test_tile_boxes_off_level_0_are_the_read_size_times_the_downsample(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(make_slide(width=4096, height=3072, seed=7), folder / "s.svs")
    index = build_index([folder], tmp_path / "idx", tile_size=128, level=1, min_tissue=0.0)
    record = index.slides[0]
    assert record.read_level == 1 and record.read_downsample and record.read_downsample > 1
    side = round(record.read_size * record.read_downsample)
    out = tmp_path / "p"
    assert run_predict(index, out, "--model", "tests.feature_models:classifier",
                       "--no-heatmaps") == 0  # fmt: skip
    tiles = TilePredictions.read_csv(out / "model-outputs-csv" / "s.csv")
    assert side > 128 and (tiles.boxes[:, 2:] == side).all()
    # neighbours in the grid are one box apart: the boxes tile the slide without gaps
    xs = np.unique(tiles.boxes[:, 0])
    assert (np.diff(xs) == side).all()


def test_a_geojson_of_an_earlier_run_is_replaced_by_wsinfers_name(
    index: SlideIndex, tmp_path: Path
) -> None:
    """Runs before this one wrote <slide>.geojson; WSInfer's layout (and the tools reading it)
    has <slide>.json. A rerun writes the slide again under that name and removes the old."""
    out = tmp_path / "p"
    assert run_predict(index, out, "--model", "tests.feature_models:classifier",
                       "--no-heatmaps") == 0  # fmt: skip
    folder = out / "model-outputs-geojson"
    assert sorted(p.name for p in folder.iterdir()) == ["bad.json", "good.json"]
    (folder / "good.json").rename(folder / "good.geojson")  # as an earlier run left it
    assert run_predict(index, out, "--model", "tests.feature_models:classifier",
                       "--no-heatmaps") == 0  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == ["bad.json", "good.json"]


def test_a_one_output_mil_model_is_decided_by_the_threshold(
    index: SlideIndex, tmp_path: Path
) -> None:
    from wsi_loader.features import extract

    features = tmp_path / "features"
    extract(index, "tests.feature_models:tiny", features, workers=0)
    for threshold, called in (("0.5", ""), ("0.005", "tumour")):
        out = tmp_path / f"mil-{threshold}"
        code = main(["predict", str(features), "--mil-model",
                     "tests.feature_models:one_output_bag", "--out", str(out), "--device", "cpu",
                     "--no-heatmaps", "--threshold", threshold])  # fmt: skip
        assert code == 0
        rows = slides_csv(out)
        assert len(rows) == 2
        assert all(float(r["prob_tumour"]) < 0.01 and r["predicted"] == called for r in rows)
