"""Features as one AnnData file (``--format anndata`` / ``--anndata FILE``): what
``anndata.read_h5ad`` reads back is the per-slide h5 files' features and coordinates, with
each tile's slide, label and split."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from wsi_loader.cli import main
from wsi_loader.index import SlideIndex

anndata = pytest.importorskip("anndata", reason="the anndata format needs anndata")


@pytest.mark.parametrize("how", ["--anndata", "--format"])
def test_anndata_round_trips_the_h5_files(index: SlideIndex, tmp_path: Path, how: str) -> None:
    out = tmp_path / "features"
    target = tmp_path / "tiles.h5ad" if how == "--anndata" else out / "features.h5ad"
    option = [how, str(target)] if how == "--anndata" else [how, "anndata"]
    code = main(
        ["features", str(index.path), "--model", "tests.feature_models:tiny", "--out", str(out),
         "--workers", "0", "--no-progress", *option]
    )  # fmt: skip
    assert code == 0
    adata = anndata.read_h5ad(target)
    summary = json.loads((out / "features.json").read_text())
    assert adata.uns["model"] == "tests.feature_models:tiny" and adata.uns["dim"] == 16
    assert list(adata.obs.columns) == ["slide", "x", "y", "label", "split"]
    start = 0
    for record in index.slides:
        with h5py.File(out / summary["slides"][record.path]["file"], "r") as h5:
            features, coords = h5["features"][:], h5["coords"][:]
        rows = slice(start, start + len(features))
        start += len(features)
        np.testing.assert_array_equal(adata.X[rows], features)
        np.testing.assert_array_equal(adata.obsm["spatial"][rows], coords)
        obs = adata.obs.iloc[rows]
        assert set(obs["slide"]) == {Path(record.path).stem}
        assert set(obs["label"]) == {record.label}
        np.testing.assert_array_equal(obs[["x", "y"]].to_numpy(), coords)
    assert start == adata.n_obs == summary["tiles"]
    assert dict(
        zip(adata.obs["slide"].astype(str), adata.obs["label"].astype(str), strict=True)
    ) == {"good": "normal", "bad": "tumour"}
