"""`predict FEATURES_DIR --mil-model`: slide probabilities of a bag model, attention per tile
(rank-normalised per slide, as CLAM draws it) and attention heatmaps."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from scipy.stats import rankdata
from torch.nn import functional as F  # noqa: N812

from tests.feature_models import BagAttention
from wsi_loader.cli import main
from wsi_loader.features import extract
from wsi_loader.index import SlideIndex


def test_mil_slide_predictions_attention_and_heatmaps(index: SlideIndex, tmp_path: Path) -> None:
    features = tmp_path / "features"
    extract(index, "tests.feature_models:tiny", features, workers=0)
    out = tmp_path / "mil"
    code = main(["predict", str(features), "--mil-model", "tests.feature_models:bag_model",
                 "--index", str(index.path), "--out", str(out), "--device", "cpu"])  # fmt: skip
    assert code == 0
    model = BagAttention().eval()
    with open(out / "slides.csv", newline="") as fh:
        rows = {r["slide"]: r for r in csv.DictReader(fh)}
    assert set(rows) == {"bad", "good"}
    for name, row in rows.items():
        with h5py.File(features / f"{name}.h5", "r") as h5:
            bag = torch.from_numpy(h5["features"][:])[None]
            coords = h5["coords"][:]
        with torch.inference_mode():
            logits, attention = model(bag, torch.ones(1, bag.shape[1], dtype=torch.bool))
        probs = F.softmax(logits[0], 0).numpy()
        assert row["label"] == {"bad": "tumour", "good": "normal"}[name]
        written = [float(row["prob_normal"]), float(row["prob_tumour"])]
        np.testing.assert_allclose(written, probs, rtol=1e-5, atol=1e-7)
        assert row["predicted"] == ("normal", "tumour")[int(np.argmax(probs))]
        with open(out / "attention-csv" / f"{name}.csv", newline="") as fh:
            tiles = list(csv.DictReader(fh))
        assert [[int(t["minx"]), int(t["miny"])] for t in tiles] == coords.tolist()
        assert {int(t["width"]) for t in tiles} == {256}
        raw = np.array([float(t["attention"]) for t in tiles])
        np.testing.assert_allclose(raw, attention[0].numpy(), rtol=1e-5)
        ranks = np.array([float(t["attention_rank"]) for t in tiles])
        np.testing.assert_allclose(ranks, rankdata(raw) / len(raw), rtol=1e-6)
        assert (out / "heatmaps" / f"{name}.png").is_file()
    summary = json.loads((out / "predict.json").read_text())
    assert summary["classes"] == ["normal", "tumour"] and summary["written"] == 2
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["slides"]["n"] == 2


def test_bags_whose_slide_file_is_not_found_say_why(
    index: SlideIndex, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A features file that names no slide (another tool's, without the 'slide' attribute)
    was warned about as "slide file not found (None)"."""
    features = tmp_path / "features"
    extract(index, "tests.feature_models:tiny", features, workers=0)
    missing = tmp_path / "moved" / "bad.svs"
    with h5py.File(features / "good.h5", "r+") as h5:
        del h5.attrs["slide"]
    with h5py.File(features / "bad.h5", "r+") as h5:
        h5.attrs["slide"] = str(missing)
    out = tmp_path / "mil"
    with caplog.at_level(logging.WARNING, logger="wsi_loader"):
        code = main(["predict", str(features), "--mil-model", "tests.feature_models:bag_model",
                     "--out", str(out), "--device", "cpu"])  # fmt: skip
    assert code == 0
    said = [r.getMessage() for r in caplog.records]
    assert (
        "good: good.h5 names no slide file (no 'slide' attribute): no heatmap; pass --index "
        "(the index the features came from)"
    ) in said, said
    assert f"bad: slide file not found ({missing}): no heatmap; pass --index" in " ".join(said)
    assert not any("None" in message for message in said), said
