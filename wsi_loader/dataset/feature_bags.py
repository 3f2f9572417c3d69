"""`FeatureBagDataset`: one item per slide, the bag of its tile embeddings (attention-MIL).

Reads the per-slide h5 files `wsi_loader.features.extract` writes (CLAM's and TRIDENT's
layout: ``features`` N x D, ``coords`` N x 2), so it also reads files those tools wrote. Each
item opens its file, reads it and closes it: nothing open is shared with forked workers, and
the dataset pickles as paths and labels. `pad_bags` collates bags of different sizes.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from wsi_loader.errors import ConfigError, InputError
from wsi_loader.index.inputs import name_cell, read_csv_table, slide_name
from wsi_loader.index.table import (
    SlideIndex,
    label_order,
    warn_missing_spelt,
    warn_similar,
)

Bag = dict[str, Any]
log = logging.getLogger(__name__)


class FeatureBagDataset(Dataset[Bag]):
    """Bags of features from a folder of ``<slide>.h5`` files.

    Labels (``label`` is -1 for a slide without one): from ``index`` (its slide labels, matched
    by slide name; ``label_names`` are the index's ``slide_label_names``), or from ``labels``, a
    mapping slide name -> label name or a CSV with ``slide`` and ``label`` columns. With
    ``split`` (and an index), only that split's slides. ``unlabelled="drop"`` leaves out slides
    without a label.

    Items: ``features`` (N x D float32), ``coords`` (N x 2 int64), ``label``, ``slide`` (name).
    ``max_instances``: at most that many instances per bag, a random subset drawn anew each
    epoch (`set_epoch`) from ``seed``: the same on every run and every rank.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        index: SlideIndex | str | os.PathLike[str] | None = None,
        labels: Mapping[str, str] | str | os.PathLike[str] | None = None,
        split: str | None = None,
        max_instances: int | None = None,
        seed: int = 0,
        unlabelled: str = "keep",
    ) -> None:
        if index is not None and labels is not None:
            raise ConfigError("give index or labels, not both", key="labels")
        if max_instances is not None and max_instances < 1:
            raise ConfigError(
                "max_instances must be >= 1", key="max_instances", value=max_instances
            )
        if unlabelled not in ("keep", "drop"):
            raise ConfigError("unlabelled must be 'keep' or 'drop'", key="unlabelled")
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise InputError("the features folder does not exist", path=str(self.folder))
        files = {p.stem: p for p in sorted(self.folder.glob("*.h5")) if not p.name.startswith(".")}
        # features.json maps slide paths to files (names changed because unsafe or taken twice)
        by_path = _files_by_path(self.folder)
        chosen: dict[str, Path] = {}
        by_name: dict[str, str] = {}
        if index is not None:
            opened = index if isinstance(index, SlideIndex) else SlideIndex.open(index)
            if split is not None:
                opened = opened.view(split=split)
            self.label_names = tuple(opened.slide_label_names)
            for record in opened.slides:
                if opened.split is not None and record.split != opened.split:
                    continue
                name = slide_name(record.path)
                file = by_path.get(record.path) or files.get(name)
                if file is not None and file.is_file():
                    chosen[name] = file
                if record.label is not None:
                    by_name[name] = record.label
        else:
            chosen = dict(files)
            if labels is not None:
                by_name = dict(labels) if isinstance(labels, Mapping) else _read_labels(labels)
                warn_similar(set(by_name.values()), "labels")
                warn_missing_spelt(list(by_name.values()))
            self.label_names = tuple(label_order(by_name.values()))
        names = list(chosen)
        without = sorted(set(by_name) - set(chosen))
        if without:  # extraction failed or has not run for them: say so, or they vanish
            shown = ", ".join(repr(n) for n in without[:5]) + (", ..." if len(without) > 5 else "")
            log.warning(
                "%d labelled slides have no feature file in %s, left out: %s",
                len(without),
                self.folder,
                shown,
            )
        if unlabelled == "drop":
            names = [n for n in names if n in by_name]
        if not names:
            raise InputError(
                "no feature files (<slide>.h5) for these slides in the folder", path=str(folder)
            )
        lookup = {name: i for i, name in enumerate(self.label_names)}
        self.slides = names
        self.files = [chosen[n] for n in names]
        self.labels = np.array([lookup.get(by_name.get(n, ""), -1) for n in names], np.int64)
        self.max_instances = max_instances
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw other instance subsets (``max_instances``) this epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Bag:
        import h5py

        path = self.files[i]
        try:
            with h5py.File(path, "r") as h5:
                features = np.asarray(h5["features"], dtype=np.float32)
                coords = np.asarray(h5["coords"], dtype=np.int64)
        except (OSError, KeyError) as exc:
            raise InputError(
                f"not a feature file with 'features' and 'coords': {exc}", path=str(path)
            ) from exc
        if len(features) != len(coords):
            raise InputError(f"{len(features)} features but {len(coords)} coords", path=str(path))
        if self.max_instances is not None and len(features) > self.max_instances:
            rng = np.random.default_rng((self.seed, self.epoch, i))
            keep = np.sort(rng.choice(len(features), size=self.max_instances, replace=False))
            features, coords = features[keep], coords[keep]
        return {
            "features": torch.from_numpy(features),
            "coords": torch.from_numpy(coords),
            "label": int(self.labels[i]),
            "slide": self.slides[i],
        }


def _files_by_path(folder: Path) -> dict[str, Path]:
    try:
        summary = json.loads((folder / "features.json").read_text(encoding="utf-8"))
        files = {path: str(entry["file"]) for path, entry in summary["slides"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    # plain names inside the folder only: a doctored file cannot point elsewhere
    return {
        path: folder / name
        for path, name in files.items()
        if name == Path(name).name and not name.startswith(".") and name.endswith(".h5")
    }


def _read_labels(path: str | os.PathLike[str]) -> dict[str, str]:
    """Slide name -> label from a CSV with ``slide`` (or CLAM's ``slide_id``) and ``label``
    columns, separated as spreadsheets write them. A slide's file name (``a.svs``) is its name
    (``a``); names with other dots (``case.1.2``) are kept whole."""
    table = os.fspath(path)
    out: dict[str, tuple[str, int]] = {}
    for line, row in read_csv_table(table, ["slide", "slide_id"]).rows:
        if "label" not in row:
            raise InputError("the labels file needs a 'label' column", path=table)
        slide, label = row.get("slide") or row.get("slide_id", ""), row["label"]
        if not slide or not label:
            raise InputError("a row needs a slide and a label", path=table, line=line)
        slide = name_cell(slide)
        if slide in out and out[slide][0] != label:
            raise InputError(
                f"slide {slide!r} is given two different labels ({out[slide][0]!r} on line "
                f"{out[slide][1]} and {label!r})",
                path=table,
                line=line,
            )
        out[slide] = (label, line)
    return {slide: label for slide, (label, _) in out.items()}


def pad_bags(items: Sequence[Bag]) -> dict[str, Any]:
    """Collate bags of different sizes: ``features`` (B, N, D) zero-padded to the largest bag,
    ``mask`` (B, N) True on real instances, ``coords`` (B, N, 2), ``lengths``, ``label`` (B,),
    ``slide`` (names)."""
    lengths = [len(item["features"]) for item in items]
    longest = max(lengths, default=0)
    dim = next((int(item["features"].shape[1]) for item in items if item["features"].ndim == 2), 0)
    features = torch.zeros((len(items), longest, dim), dtype=torch.float32)
    coords = torch.zeros((len(items), longest, 2), dtype=torch.int64)
    mask = torch.zeros((len(items), longest), dtype=torch.bool)
    for b, item in enumerate(items):
        n = lengths[b]
        features[b, :n] = item["features"]
        coords[b, :n] = item["coords"]
        mask[b, :n] = True
    return {
        "features": features,
        "coords": coords,
        "mask": mask,
        "lengths": torch.tensor(lengths, dtype=torch.int64),
        "label": torch.tensor([item["label"] for item in items], dtype=torch.int64),
        "slide": [item["slide"] for item in items],
    }
