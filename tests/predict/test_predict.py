"""`wsi_loader.predict` / `wsi-loader predict`: tile probabilities against the model applied to
OpenSlide's pixels, the WSInfer layout, QuPath tile objects read back by our reader, heatmaps
of overlapping grids, slide results and metrics, resuming after kill -9, bad models."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import geojson
import numpy as np
import pytest
import shapely
import torch
from PIL import Image
from torch.nn import functional as F  # noqa: N812

from tests.conftest import REPO, SlideFactory, corrupt_rows
from tests.feature_models import Oriented, PoolLinear, classifier
from tests.features.test_features import hang_reads_of_good_slide, openslide_tile
from tests.torchrun import torchrun_cli
from wsi_loader.cli import main
from wsi_loader.errors import ConfigError, ModelOutputError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index.annotations._formats import read_annotations
from wsi_loader.predict._heatmaps import SlideHeatmap, prediction_heatmap
from wsi_loader.predict._outputs import _IDS, TilePredictions, tile_id
from wsi_loader.predict._run import predict

MEAN = torch.tensor(classifier()[1]["mean"]).view(1, 3, 1, 1)
STD = torch.tensor(classifier()[1]["std"]).view(1, 3, 1, 1)


def row_of(index: SlideIndex, slide: int, x: int, y: int) -> int:
    cols = index.columns
    hit = (cols["slide_id"] == slide) & (cols["l0_x"] == x) & (cols["l0_y"] == y)
    return int(np.flatnonzero(hit)[0])


@pytest.mark.parametrize("workers", [0, 2])
def test_probabilities_equal_the_model_on_openslide_pixels(
    index: SlideIndex, tmp_path: Path, workers: int
) -> None:
    out = tmp_path / "p"
    report = predict(index, "tests.feature_models:classifier", out, batch_size=16, workers=workers)
    bad = corrupt_rows(index)
    assert report.classes == ("normal", "tumour")
    assert report.written == 2 and report.tiles == len(index) - len(bad)
    model = PoolLinear(dim=2).eval()
    for sid, record in enumerate(index.slides):
        stem = Path(record.path).stem
        with open(out / "model-outputs-csv" / f"{stem}.csv", newline="") as fh:
            header = next(csv.reader(fh))
        assert header == ["minx", "miny", "width", "height", "prob_normal", "prob_tumour"]
        tiles = TilePredictions.read_csv(out / "model-outputs-csv" / f"{stem}.csv")
        assert (tiles.boxes[:, 2:] == 256).all()
        rows = [row_of(index, sid, x, y) for x, y in tiles.boxes[:, :2].tolist()]
        assert not set(rows) & set(bad.tolist())  # failed tiles are left out
        np.testing.assert_allclose(tiles.probabilities.sum(axis=1), 1, atol=1e-6)
        for i in np.random.default_rng(sid).choice(len(rows), size=4, replace=False):
            tile = F.interpolate(
                openslide_tile(index, rows[i]), size=(64, 64), mode="bilinear", antialias=True
            )
            with torch.inference_mode():
                expected = F.softmax(model((tile - MEAN) / STD), dim=1)[0].numpy()
            np.testing.assert_allclose(tiles.probabilities[i], expected, atol=1e-5)
    summary = json.loads((out / "predict.json").read_text())
    assert summary["classes"] == ["normal", "tumour"] and summary["activation"] == "softmax"
    assert summary["failed"] == len(bad)
    assert {f["reason"] for f in summary["failures"]} == {"ValueError: Bogus marker length"}


def test_tile_ids_are_uuid5_of_the_slide_and_box() -> None:
    for name in ("", "a\0 1\0 2\0 224\0 224", "tést (2)\0 0\0 0\0 1\0 1", "x" * 300):
        assert tile_id(name) == str(uuid.uuid5(_IDS, name))


def test_geojson_is_valid_and_read_back_by_our_qupath_reader(
    index: SlideIndex, tmp_path: Path
) -> None:
    out = tmp_path / "p"
    predict(index, "tests.feature_models:classifier", out, workers=0, heatmaps=False)
    for record in index.slides:
        stem = Path(record.path).stem
        tiles = TilePredictions.read_csv(out / "model-outputs-csv" / f"{stem}.csv")
        path = out / "model-outputs-geojson" / f"{stem}.json"
        document = json.loads(path.read_text())
        checked = geojson.loads(path.read_text())  # python-geojson's validation
        assert checked.is_valid, checked.errors()
        assert document["type"] == "FeatureCollection"
        assert len(document["features"]) == len(tiles.boxes)
        for feature in document["features"][:20]:  # GeoJSON: closed, valid polygon rings
            assert feature["type"] == "Feature" and feature["properties"]["objectType"] == "tile"
            ring = feature["geometry"]["coordinates"][0]
            assert ring[0] == ring[-1] and len(ring) == 5
            assert shapely.geometry.shape(feature["geometry"]).is_valid
        first = document["features"][0]["properties"]["measurements"]
        assert list(first) == ["prob_normal", "prob_tumour"]
        assert np.float32(list(first.values())).tolist() == tiles.probabilities[0].tolist()
        shapes = read_annotations(str(path), objects=("tile",)).shapes
        read = sorted((tuple(int(v) for v in s.geometry.bounds), s.name) for s in shapes)
        names = np.array(["normal", "tumour"])[np.argmax(tiles.probabilities, axis=1)]
        expected = sorted(
            ((x, y, x + w, y + h), str(n))
            for (x, y, w, h), n in zip(tiles.boxes.tolist(), names, strict=True)
        )
        assert read == expected
        ids = [feature["id"] for feature in document["features"]]
        assert len(set(ids)) == len(ids)  # one per tile, the same in every run
        x, y, w, h = tiles.boxes[0].tolist()
        assert ids[0] == str(uuid.uuid5(_IDS, f"{stem}\0{x}\0{y}\0{w}\0{h}"))  # as written before


def test_an_overlapping_grids_heatmap_pixel_is_the_mean_of_the_tiles_covering_it(
    archive: Path, tmp_path: Path
) -> None:
    index = build_index(
        [archive / "good.svs"], tmp_path / "idx", tile_size=256, stride=128, level=0,
        min_tissue=0.0,
    )  # fmt: skip
    out = tmp_path / "p"
    predict(index, "tests.feature_models:classifier", out, workers=0, heatmap_size=256)
    tiles = TilePredictions.read_csv(out / "model-outputs-csv" / "good.csv")
    assert (tiles.boxes[1, 0] - tiles.boxes[0, 0]) == 128  # neighbours overlap by half
    heatmap = SlideHeatmap(
        index.slide_path(0), tiles.boxes, tiles.probabilities, tiles.classes, max_size=256,
        mpp=index.slides[0].mpp, title="good",
    )  # fmt: skip
    # predict drew exactly this picture
    assert (out / "heatmaps" / "good.png").read_bytes() == heatmap._repr_png_()
    s = heatmap.scale
    rng = np.random.default_rng(0)
    height, width = heatmap.values.shape[:2]
    covered_by = {1: 0, 2: 0, 4: 0}
    for _ in range(200):
        i, j = int(rng.integers(height)), int(rng.integers(width))
        cx, cy = (j + 0.5) / s, (i + 0.5) / s  # the pixel centre, level-0
        x, y, w, h = tiles.boxes.T
        over = (x <= cx) & (cx < x + w) & (y <= cy) & (cy < y + h)
        if not over.any():
            assert np.isnan(heatmap.values[i, j]).all()
            continue
        covered_by[int(over.sum())] = covered_by.get(int(over.sum()), 0) + 1
        expected = tiles.probabilities[over].astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(heatmap.values[i, j], expected, rtol=1e-5)
    assert covered_by[4] > 50  # most pixels lie under 4 tiles of the half-step grid
    with Image.open(out / "heatmaps" / "good.png") as png:
        assert png.width >= 2 * width  # two panels, one per class


def test_slides_csv_and_metrics_from_the_index_labels(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "p"
    report = predict(index, "tests.feature_models:classifier", out, workers=0, top_k=5)
    with open(out / "slides.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["name"] for r in rows] == ["bad", "good"]
    assert [r["label"] for r in rows] == ["tumour", "normal"]
    for row in rows:
        tiles = TilePredictions.read_csv(out / "model-outputs-csv" / f"{row['name']}.csv")
        p = tiles.probabilities.astype(np.float64)
        assert int(row["tiles"]) == len(p)
        assert float(row["mean_tumour"]) == pytest.approx(p[:, 1].mean(), rel=1e-5)
        assert float(row["max_normal"]) == pytest.approx(p[:, 0].max(), rel=1e-5)
        top5 = np.sort(p[:, 1])[-5:].mean()
        assert float(row["top5_mean_tumour"]) == pytest.approx(top5, rel=1e-5)
        share = (p[:, 0] >= 0.5).mean()
        assert float(row["share_ge_0.5_normal"]) == pytest.approx(share, rel=1e-5)
        assert row["predicted"] == ("normal", "tumour")[int(np.argmax(p.mean(axis=0)))]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["slides"]["n"] == 2 and report.metrics == metrics
    assert set(metrics["slides"]["roc_auc"]) == {"normal", "tumour"}
    assert np.asarray(metrics["slides"]["confusion_matrix"]["counts"]).sum() == 2


def test_metrics_equal_scikit_learn_on_a_constructed_case() -> None:
    from sklearn.metrics import (
        accuracy_score,
        balanced_accuracy_score,
        confusion_matrix,
        roc_auc_score,
    )

    from wsi_loader.predict._metrics import SlideRule, metrics, rank_auc

    rng = np.random.default_rng(7)
    labels = rng.integers(0, 3, size=120)
    scores = rng.dirichlet([1, 1, 1], size=120)
    scores[np.arange(120), labels] += 0.4  # informative, not perfect
    scores /= scores.sum(axis=1, keepdims=True)
    result = metrics(labels, scores, ("a", "b", "c"), SlideRule())
    guess = scores.argmax(axis=1)
    assert result["accuracy"] == accuracy_score(labels, guess)
    assert result["balanced_accuracy"] == balanced_accuracy_score(labels, guess)
    assert result["confusion_matrix"]["counts"] == confusion_matrix(labels, guess).tolist()
    for i, name in enumerate("abc"):
        auc = result["roc_auc"][name]
        assert auc["auc"] == roc_auc_score(labels == i, scores[:, i])
        # what the bootstrap computes: the same AUC, without scikit-learn's per-call checks
        tied = np.round(scores[:, i], 1)  # ties count half, as in scikit-learn
        assert rank_auc(labels == i, tied) == pytest.approx(roc_auc_score(labels == i, tied))
        low, high = auc["ci95"]
        assert low < auc["auc"] < high and low > 0.5 and high <= 1
        assert auc["bootstrap_rounds"] == 1000
    # two classes, scores that sum to 1: the same resamples for both, so both classes get the
    # same AUCs and intervals, and one is never missing where the other is there (with a seed
    # per class they differed, and on 2 slides one interval was said and the other not)
    two = rng.integers(0, 2, size=40)
    p1 = np.clip(two * 0.25 + rng.integers(0, 5, size=40) / 8, 0, 1)  # exact eighths: 1 - p
    pair = metrics(two, np.stack([1 - p1, p1], axis=1), ("x", "y"), SlideRule())
    assert pair["roc_auc"]["x"] == pair["roc_auc"]["y"]
    assert pair["roc_auc"]["x"]["ci95"][0] < pair["roc_auc"]["x"]["auc"]
    # one of each class: half the resamples hold both, too few of 10 for an interval
    few = metrics(np.array([0, 1]), np.array([[0.4, 0.6], [0.3, 0.7]]), ("x", "y"), SlideRule(),
                  rounds=10, seed=3)  # fmt: skip
    assert few["roc_auc"]["x"] == few["roc_auc"]["y"]
    assert few["roc_auc"]["y"]["bootstrap_rounds"] == 3  # of 10, with seed 3
    assert few["roc_auc"]["y"]["ci95"] == [None, None]
    assert few["roc_auc"]["y"]["why"].startswith("3 of 10 resamples hold both")
    # grouped (tiles of slides): the interval of resampled groups is wider than of items
    groups = np.repeat(np.arange(12), 10)
    grouped = metrics(labels, scores, ("a", "b", "c"), SlideRule(), groups=groups, rounds=200)
    assert grouped["roc_auc"]["a"]["auc"] == result["roc_auc"]["a"]["auc"]


def test_an_interval_from_few_slides_is_said_to_be_unreliable() -> None:
    from wsi_loader.predict._metrics import RELIABLE_BOOTSTRAP_UNITS, SlideRule, metrics, table

    rng = np.random.default_rng(5)
    many = RELIABLE_BOOTSTRAP_UNITS
    for n in (3, many - 1, many):
        labels = np.arange(n) % 2
        p1 = np.clip(labels * 0.3 + rng.random(n) * 0.7, 0, 1)
        result = metrics(labels, np.stack([1 - p1, p1], axis=1), ("x", "y"), SlideRule(),
                         rounds=200)  # fmt: skip
        printed = table(result, "slide level")
        caveat = f"n={n} slides: interval unreliable (fewer than {many} slides to resample)"
        assert result["bootstrap"] == {"slides": n, "reliable": n >= many}
        assert (caveat in printed) is (n < many), printed
    # tiles: what the bootstrap resamples are their slides (groups), not the tiles
    groups = np.repeat(np.arange(4), 10)
    labels = groups % 2
    p1 = np.clip(labels * 0.3 + rng.random(40) * 0.7, 0, 1)
    tiles = metrics(labels, np.stack([1 - p1, p1], axis=1), ("x", "y"), SlideRule(),
                    groups=groups, rounds=200)  # fmt: skip
    assert tiles["bootstrap"] == {"slides": 4, "reliable": False}
    assert "n=4 slides: interval unreliable" in table(tiles, "tile level")


def test_kill_9_midway_then_rerun_gives_byte_identical_csvs(
    index: SlideIndex, tmp_path: Path
) -> None:
    whole = tmp_path / "whole"
    predict(index, "tests.feature_models:slow_classifier", whole, batch_size=16, workers=0)
    out = tmp_path / "killed"
    command = [
        sys.executable, "-m", "wsi_loader.cli", "predict", str(index.path),
        "--model", "tests.feature_models:slow_classifier", "--out", str(out),
        "--batch-size", "16", "--workers", "0", "--device", "cpu", "--no-progress",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not list((out / ".predict-state").glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()  # type: ignore[union-attr]
    assert len(list((out / ".predict-state").glob("*.json"))) == 1  # killed in the second slide
    report = predict(index, "tests.feature_models:slow_classifier", out, batch_size=16, workers=0)
    assert (report.written, report.skipped) == (1, 1)
    for folder in ("model-outputs-csv", "model-outputs-geojson", "heatmaps"):
        ours = {p.name: p.read_bytes() for p in (out / folder).iterdir()}
        assert ours == {p.name: p.read_bytes() for p in (whole / folder).iterdir()}, folder
    assert (out / "slides.csv").read_bytes() == (whole / "slides.csv").read_bytes()
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_a_nan_model_fails_its_slides_by_name(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    code = main(["predict", str(index.path), "--model", "tests.feature_models:nan_classifier",
                 "--out", str(out), "--workers", "0", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    first, second = (s.path for s in index.slides)
    assert code == 1
    assert f"failed: {first}: the model returned NaN or infinite values for" in err
    assert "error: the model's outputs were not finite for some slides\n" in err
    assert "float16" not in err  # the advice is for --dtype float16 runs only
    assert (out / "model-outputs-csv" / f"{Path(second).stem}.csv").is_file()
    assert not (out / "model-outputs-csv" / f"{Path(first).stem}.csv").exists()
    summary = json.loads((out / "predict.json").read_text())
    assert [f["slide"] for f in summary["failed_slides"]] == [first]
    with open(out / "slides.csv", newline="") as fh:
        assert [r["slide"] for r in csv.DictReader(fh)] == [second]


def test_class_names_come_in_order_and_a_count_mismatch_stops_before_reading(
    index: SlideIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsi_loader.dataset import _reading as reading

    def no_reads(*args: object, **kwargs: object) -> None:
        raise AssertionError("a slide was read")

    with monkeypatch.context() as patch:
        patch.setattr(reading.TileReader, "read", no_reads)
        with pytest.raises(ConfigError, match="the model gives 2 outputs per tile but classes"):
            predict(index, "tests.feature_models:classifier", tmp_path / "a", classes=["x"])
        with pytest.raises(ConfigError, match="gives 3 outputs per tile but the index's label"):
            predict(index, PoolLinear(dim=3), tmp_path / "b", workers=0)
    # --classes first, then the model's config, then the index's labels
    given = predict(index, "tests.feature_models:classifier", tmp_path / "c", workers=0,
                    classes=["x", "y"], heatmaps=False)  # fmt: skip
    assert given.classes == ("x", "y")
    from_index = predict(index, "tests.feature_models:classifier_plain", tmp_path / "d",
                         workers=0, heatmaps=False)  # fmt: skip
    assert from_index.classes == tuple(index.label_names) == ("normal", "tumour")


def test_model_output_of_the_wrong_width_is_named(index: SlideIndex, tmp_path: Path) -> None:
    with pytest.raises(ModelOutputError, match=r"tuple of 2, not a tensor .*on a blank tile\)$"):
        predict(index, "tests.feature_models:returns_tuple", tmp_path / "p", workers=0)
    named = ModelOutputError("5 rows for 4 tiles", model="m", slides=["a.svs", "b.svs"])
    assert str(named) == "model m: 5 rows for 4 tiles (slides of the batch: a.svs, b.svs)"


def test_the_float16_advice_comes_with_float16_runs_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from wsi_loader.cli._model_pass import unfinished_slides
    from wsi_loader.models._pass import PassReport

    report = PassReport(failed_slides=[{"slide": "a.svs", "reason": "NaN"}])
    assert unfinished_slides(report, dtype="float16") == 1
    assert "(with --dtype float16, try float32 or bfloat16)" in capsys.readouterr().err
    assert unfinished_slides(report, dtype="bfloat16") == 1
    assert "float16" not in capsys.readouterr().err


def test_tta_averages_the_flips_and_turns(index: SlideIndex, tmp_path: Path) -> None:
    model = Oriented()
    plain = predict(index, model, tmp_path / "none", workers=0, heatmaps=False)
    turned = predict(index, model, tmp_path / "d4", workers=0, tta="d4", heatmaps=False)
    assert plain.classes == turned.classes
    stem = Path(index.slides[0].path).stem
    none = TilePredictions.read_csv(tmp_path / "none" / "model-outputs-csv" / f"{stem}.csv")
    d4 = TilePredictions.read_csv(tmp_path / "d4" / "model-outputs-csv" / f"{stem}.csv")
    assert not np.allclose(none.probabilities, d4.probabilities)
    row = row_of(index, 0, *none.boxes[3, :2].tolist())
    tile = openslide_tile(index, row)
    views = [torch.rot90(tile, k, dims=(2, 3)) for k in range(4)]
    views += [v.flip(-1) for v in views]
    with torch.inference_mode():
        expected = torch.stack([F.softmax(model(v), 1)[0] for v in views]).mean(0).numpy()
    np.testing.assert_allclose(d4.probabilities[3], expected, atol=1e-5)


def test_cli_interface_and_a_torchscript_model_with_its_config(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.models.test_models import scripted

    folder = tmp_path / "model"
    folder.mkdir()
    scripted(folder / "torchscript_model.pt", PoolLinear(dim=2))
    (folder / "config.json").write_text(json.dumps({
        "spec_version": "1.0", "num_classes": 2, "class_names": ["Other", "Tumor"],
        "patch_size_pixels": 256, "spacing_um_px": 0.5,
        "transform": [{"name": "Resize", "arguments": {"size": 64}}, {"name": "ToTensor"}],
    }))  # fmt: skip
    out = tmp_path / "p"
    code = main(["predict", str(index.path), "--model", str(folder / "torchscript_model.pt"),
                 "--out", str(out), "--workers", "0", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert "slide level (n=0)" not in err
    for record in index.slides:
        stem = Path(record.path).stem
        for file in (f"model-outputs-csv/{stem}.csv", f"model-outputs-geojson/{stem}.json",
                     f"heatmaps/{stem}.png"):  # fmt: skip
            assert (out / file).is_file(), file
    assert (out / "slides.csv").is_file()
    tiles = TilePredictions.read_csv(out / "model-outputs-csv" / "good.csv")
    assert tiles.classes == ("Other", "Tumor")
    # the index's labels are not the model's classes: no metrics, said
    assert not (out / "metrics.json").exists()


def test_inspect_predictions_draws_the_same_heatmap(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    predict(index, "tests.feature_models:classifier", out, workers=0, heatmap_size=300)
    for record in index.slides:  # bad.svs has failed tiles: hatched in both
        stem = Path(record.path).stem
        png = tmp_path / f"{stem}.png"
        code = main(["inspect", str(index.path), "--predictions", str(out), "--slide", record.path,
                     "--out", str(png), "--max-size", "300"])  # fmt: skip
        assert code == 0
        assert png.read_bytes() == (out / "heatmaps" / f"{stem}.png").read_bytes()
    one = tmp_path / "one.png"
    assert main(["inspect", str(index.path), "--predictions", str(out), "--heatmap-class",
                 "tumour", "--out", str(one)]) == 0  # fmt: skip
    capsys.readouterr()
    # without --predictions there is no heatmap whose class it could choose: said, not ignored
    assert main(["inspect", str(index.path), "--heatmap-class", "tumour",
                 "--out", str(tmp_path / "overview.png")]) == 2  # fmt: skip
    assert "--heatmap-class goes with --predictions" in capsys.readouterr().err
    assert not (tmp_path / "overview.png").exists()
    single = prediction_heatmap(index, out, "good.svs", heatmap_class="tumour", max_size=300)
    assert single.names == ["tumour"] and single.values.shape[2] == 1
    both = prediction_heatmap(index, out, "good.svs", max_size=300)
    np.testing.assert_array_equal(single.values[..., 0], both.values[..., 1])
    assert main(["inspect", str(index.path), "--predictions", str(tmp_path), "--out",
                 str(one)]) == 2  # fmt: skip


def test_without_scikit_learn_there_are_no_metrics_and_it_is_said(
    index: SlideIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "sklearn.metrics", None)  # not installed
    report = predict(index, "tests.feature_models:classifier", tmp_path / "p", workers=0,
                     heatmaps=False)  # fmt: skip
    assert report.written == 2 and report.metrics is None
    assert not (tmp_path / "p" / "metrics.json").exists()
    assert (tmp_path / "p" / "slides.csv").is_file()
    assert "pip install 'wsi_loader[predict]'" in caplog.text


@pytest.mark.slow
def test_torchrun_ranks_split_the_slides(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    torchrun_cli(
        tmp_path, "predict", str(index.path),
        "--model", "tests.feature_models:classifier", "--out", str(out), "--workers", "0",
        "--device", "cpu", "--no-progress", timeout=240,
    ).check_returncode()  # fmt: skip
    summary = json.loads((out / "predict.json").read_text())
    assert summary["ranks"] == 2 and summary["written"] == 2
    assert sorted(summary["written_by"].values()) == [0, 1]  # one slide each
    with open(out / "slides.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 2
    assert not list(out.glob(".predict-rank*"))


def test_tile_level_metrics_when_tiles_carry_annotation_labels(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    from sklearn.metrics import roc_auc_score

    from tests.index.test_annotated_index import annotated_archive, build, label_of, tile

    root = annotated_archive(tmp_path, make_slide(width=2048, height=1536, seed=3))
    index = build(root, label_from="annotations", background_label="Other")
    out = tmp_path / "p"
    report = predict(index, PoolLinear(dim=len(index.label_names)), out, workers=0,
                     heatmaps=False)  # fmt: skip
    assert report.classes == index.label_names
    assert report.metrics is not None and "tiles" in report.metrics
    truth, scores = [], []
    for sid, record in enumerate(index.slides):
        csv_file = out / "model-outputs-csv" / f"{Path(record.path).stem}.csv"
        if not csv_file.is_file():
            continue
        tiles = TilePredictions.read_csv(csv_file)
        for (x, y), p in zip(tiles.boxes[:, :2].tolist(), tiles.probabilities, strict=True):
            truth.append(label_of(index, tile(index, sid, x, y)))
            scores.append(p)
    tiles_metrics = report.metrics["tiles"]
    assert tiles_metrics["n"] == len(truth)
    column = list(index.label_names).index("Tumor")
    expected = roc_auc_score(np.array(truth) == "Tumor", np.array(scores)[:, column])
    assert tiles_metrics["roc_auc"]["Tumor"]["auc"] == pytest.approx(expected)


@pytest.fixture(scope="module")
def two_stains(tmp_path_factory: pytest.TempPathFactory) -> SlideIndex:
    """Two slides stained differently (as tests/stain/test_stain_outputs.py makes them)."""
    from tests.stain.test_stain_outputs import STAINS
    from wsi_loader.synthetic import SlideSpec, write_svs

    folder = tmp_path_factory.mktemp("two")
    for i, stain in enumerate(STAINS):
        write_svs(str(folder / f"s{i}.svs"), SlideSpec(2560, 2048, seed=10 + i, stain=stain))
    return build_index([folder], folder / "idx", tile_size=256, level=0, min_tissue=0.5)


def test_stain_normalisation_changes_the_probabilities_and_is_part_of_the_content(
    two_stains: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wsi_loader.stain import Normalize, resolve_target

    out = tmp_path / "p"
    predict(two_stains, "tests.feature_models:classifier", out, workers=0, heatmaps=False)
    stem = Path(two_stains.slides[0].path).stem
    plain = TilePredictions.read_csv(out / "model-outputs-csv" / f"{stem}.csv").probabilities
    target = resolve_target(two_stains.slide_path(1))
    report = predict(two_stains, "tests.feature_models:classifier", out, workers=0,
                     heatmaps=False, stain=Normalize("macenko", target=target),
                     overwrite=True)  # fmt: skip
    assert report.written == 2 and report.skipped == 0  # the stain is part of the content
    stained = TilePredictions.read_csv(out / "model-outputs-csv" / f"{stem}.csv").probabilities
    assert plain.shape == stained.shape and not np.allclose(plain, stained)
    code = main(["predict", str(two_stains.path), "--model", "tests.feature_models:classifier",
                 "--out", str(tmp_path / "cli"), "--workers", "0", "--no-progress",
                 "--stain", "reinhard"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    # a config file's stain section asks for the same
    config = tmp_path / "stain.yaml"
    config.write_text("stain:\n  normalize: reinhard\n")
    code = main(["predict", str(two_stains.path), "--model", "tests.feature_models:classifier",
                 "--out", str(tmp_path / "config"), "--workers", "0", "--no-progress",
                 "--config", str(config)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    from_flags, from_file = (
        TilePredictions.read_csv(tmp_path / name / "model-outputs-csv" / f"{stem}.csv")
        for name in ("cli", "config")
    )
    assert np.array_equal(from_file.probabilities, from_flags.probabilities)
    assert not np.allclose(from_file.probabilities, plain)
    # and is refused with a MIL model, as --stain is
    code = main(["predict", str(two_stains.path), "--mil-model", "m.pt", "--out",
                 str(tmp_path / "mil"), "--config", str(config)])  # fmt: skip
    assert code == 2 and "goes with --model" in capsys.readouterr().err


def test_the_softmax_is_torchs_softmax() -> None:
    from wsi_loader.predict._run import _softmax

    logits = torch.randn(64, 5, generator=torch.Generator().manual_seed(1)) * 30
    logits[0] = torch.tensor([1e4, -1e4, 0.0, 1e4, 3.0])  # large: shifted by the maximum
    # within an ulp or two of float32 at 1.0 (exp of another implementation)
    torch.testing.assert_close(_softmax(logits), F.softmax(logits, 1), rtol=0, atol=2.5e-7)


@pytest.mark.timeout(600)
def test_a_slide_that_hangs_is_left_for_the_next_run_after_timeout(
    index: SlideIndex,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hook_workers: Callable[[str], None],
) -> None:
    """As for features (the same pass): with ``timeout`` the slide whose read hangs gets no
    files and is listed as incomplete with the reason, the other slide is written, and the
    next run does the hung slide only."""
    hang_reads_of_good_slide(monkeypatch, hook_workers)
    out = tmp_path / "p"
    # 60 s: the hung read never ends, and a good batch (the first one waits for the worker to
    # start) must not come near it on a busy machine
    report = predict(index, "tests.feature_models:classifier", out, workers=1, timeout=60)
    good = next(s.path for s in index.slides if s.path.endswith("good.svs"))
    assert [entry["slide"] for entry in report.incomplete] == [good]
    assert "no batch within timeout=60 s while reading it" in report.incomplete[0]["reason"]
    assert (out / "model-outputs-csv" / "bad.csv").exists()
    assert not (out / "model-outputs-csv" / "good.csv").exists()
    summary = json.loads((out / "predict.json").read_text())
    assert [entry["slide"] for entry in summary["incomplete"]] == [good]
    with open(out / "slides.csv", newline="") as fh:
        assert [row["name"] for row in csv.DictReader(fh)] == ["bad"]
    monkeypatch.undo()  # the share answers again
    again = predict(index, "tests.feature_models:classifier", out, workers=1, timeout=60)
    assert (again.written, again.skipped, again.incomplete) == (1, 1, [])


@pytest.mark.parametrize("rule", ["max", "topk"])
def test_multi_label_sigmoids_and_every_class_over_the_threshold(
    index: SlideIndex, tmp_path: Path, rule: str
) -> None:
    out = tmp_path / "p"
    predict(index, "tests.feature_models:classifier", out, workers=0, multi_label=True,
            slide_rule=rule, top_k=3, threshold=0.6)  # fmt: skip
    model = PoolLinear(dim=2)
    with open(out / "slides.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2
    for row in rows:
        tiles = TilePredictions.read_csv(out / "model-outputs-csv" / f"{row['name']}.csv")
        slide = next(i for i, s in enumerate(index.slides) if Path(s.path).stem == row["name"])
        # the tiles' own sigmoids: each class on its own (rows need not sum to 1)
        for x, y in tiles.boxes[:3, :2].tolist():
            tile = F.interpolate(
                openslide_tile(index, row_of(index, slide, x, y)),
                size=(64, 64),
                mode="bilinear",
                antialias=True,
            )
            with torch.inference_mode():
                expected = torch.sigmoid(model.eval()((tile - MEAN) / STD))[0].numpy()
            np.testing.assert_allclose(
                tiles.probabilities[row_of_box(tiles, x, y)], expected, atol=1e-5
            )
        p = np.sort(tiles.probabilities.astype(np.float64), axis=0)
        score = p[-1] if rule == "max" else p[-3:].mean(axis=0)
        chosen = [c for c, s in zip(("normal", "tumour"), score, strict=True) if s >= 0.6]
        assert row["predicted"] == ";".join(chosen)
    run = json.loads((out / "predict.json").read_text())
    assert run["activation"] == "sigmoid" and run["slide_rule"]["rule"] == rule
    assert "every class whose" in run["slide_rule"]["predicted"]


def row_of_box(tiles: TilePredictions, x: int, y: int) -> int:
    return int(np.flatnonzero((tiles.boxes[:, 0] == x) & (tiles.boxes[:, 1] == y))[0])


def test_split_predicts_the_slides_of_that_split_only(archive: Path, tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label,split\ngood,normal,test\nbad,tumour,train\n")
    index = build_index([archive], tmp_path / "idx", tile_size=256, level=0, labels=str(labels))
    out = tmp_path / "p"
    code = main(["predict", str(index.path), "--model", "tests.feature_models:classifier",
                 "--out", str(out), "--split", "test", "--workers", "0",
                 "--no-progress"])  # fmt: skip
    assert code == 0
    assert sorted(p.name for p in (out / "model-outputs-csv").iterdir()) == ["good.csv"]
    with open(out / "slides.csv", newline="") as fh:
        assert [(r["name"], r["label"]) for r in csv.DictReader(fh)] == [("good", "normal")]
    run = json.loads((out / "predict.json").read_text())
    assert list(run["slides"]) == [str(archive / "good.svs")]


@pytest.mark.parametrize("command", ["predict", "features", "bench"])
@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:x"])
def test_a_device_that_is_not_there_is_an_error_before_any_slide_is_read(
    index: SlideIndex,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    device: str,
) -> None:
    from wsi_loader.dataset import _reading as reading

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is there")

    def no_reads(*args: object, **kwargs: object) -> None:
        raise AssertionError("a slide was read")

    monkeypatch.setattr(reading.TileReader, "read", no_reads)
    out = tmp_path / "out"
    model = [] if command == "bench" else ["--model", "tests.feature_models:classifier"]
    outs = [] if command == "bench" else ["--out", str(out)]
    code = main([command, str(index.path), *model, *outs, "--device", device, "--workers", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert f"device {device!r}" in err
    wanted = "CUDA is not available" if device == "cuda" else "not a device"
    assert wanted in err
    assert not out.exists()


def test_average_ranks_equal_scipy_rankdata_with_ties() -> None:
    from scipy.stats import rankdata

    from wsi_loader.predict._metrics import average_ranks

    rng = np.random.default_rng(3)
    for values in (
        rng.integers(0, 5, 200).astype(float),  # many ties
        rng.random(57),
        np.array([0.5]),
        np.array([2.0, 2.0, 2.0]),
        rng.integers(0, 3, (4, 6)).astype(float)[0],
    ):
        np.testing.assert_array_equal(average_ranks(values), rankdata(values, method="average"))
