"""A features folder as one AnnData file (``.h5ad``) for the scverse world: ``X`` the tile
features, ``obs`` each tile's slide, level-0 x and y, label and split, ``obsm["spatial"]`` the
level-0 coordinates (what squidpy and LazySlide plot with), ``uns`` the model and dims.
Read back by ``anndata.read_h5ad`` and scanpy as they are."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from wsi_loader.errors import ConfigError, InputError
from wsi_loader.index import SlideIndex


def write_anndata(
    features_dir: str | os.PathLike[str], index: SlideIndex, out_file: str | os.PathLike[str]
) -> int:
    """Write the per-slide h5 files of ``features_dir`` (listed in its features.json) as
    one ``.h5ad``; the number of tiles written. Slides without a file are left out."""
    try:
        import anndata  # type: ignore[import-untyped]
        import pandas as pd  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ConfigError(
            "the anndata format needs anndata (pip install anndata)", key="format"
        ) from exc
    folder = Path(features_dir)
    try:
        summary = json.loads((folder / "features.json").read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"not a features folder ({exc})", path=str(folder)) from exc
    listed: dict[str, Any] = summary.get("slides") or {}
    parts, coords, obs = [], [], []
    for record in index.slides:
        entry = listed.get(record.path)
        file = folder / entry["file"] if entry and entry.get("file") else None
        if file is None or not file.is_file():
            continue
        with h5py.File(file, "r") as h5:
            values = np.asarray(h5["features"][:], dtype=np.float32)
            xy = np.asarray(h5["coords"][:], dtype=np.int64)
        parts.append(values)
        coords.append(xy)
        name = Path(record.path).stem
        obs.append(
            pd.DataFrame(
                {
                    "slide": name,
                    "x": xy[:, 0],
                    "y": xy[:, 1],
                    "label": record.label if record.label is not None else "",
                    "split": record.split if record.split is not None else "",
                }
            )
        )
    if not parts:
        raise InputError("no slide's features to write", path=str(folder))
    table = pd.concat(obs, ignore_index=True)
    for column in ("slide", "label", "split"):
        table[column] = table[column].astype("category")
    table.index = table.index.astype(str)
    adata = anndata.AnnData(
        X=np.concatenate(parts),
        obs=table,
        obsm={"spatial": np.concatenate(coords)},
        uns={"model": str(summary.get("model", "")), "dim": int(parts[0].shape[1])},
    )
    out = Path(out_file)
    partial = out.with_name(f".{out.name}.partial")
    adata.write_h5ad(partial)
    partial.replace(out)  # a reader never sees half a file
    return int(adata.n_obs)
