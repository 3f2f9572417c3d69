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
from wsi_loader.index._csv_tables import read_csv_table
from wsi_loader.index._inputs import name_cell, slide_name
from wsi_loader.index._labels import label_order, split_mask, warn_missing_spelt, warn_similar
from wsi_loader.index._naming import h5_file_names
from wsi_loader.index._table import SlideIndex

Bag = dict[str, Any]
log = logging.getLogger(__name__)


class FeatureBagDataset(Dataset[Bag]):
    """Bags of features from a folder of ``<slide>.h5`` files.

    With ``index``: one bag per indexed slide (by path: two slides named ``case`` in different
    folders are two bags, their files found through ``features.json`` or by the names
    extraction gives them, ``case.h5`` and ``case-s1.h5``), labelled with the index's slide
    labels (``label_names`` are its ``slide_label_names``); with ``split``, only that split's
    slides. Otherwise one bag per file, labelled from ``labels``, a mapping name -> label name
    or a CSV with ``slide`` and ``label`` columns: by the file's name, then by its slide's
    name (a name two files' slides share is refused: pass the index). ``label`` is -1 for a
    slide without one; ``unlabelled="drop"`` leaves such slides out.

    Items: ``features`` (N x D float32), ``coords`` (N x 2 int64), ``label``, ``slide`` (the
    file's name, unique in the folder); ``paths[i]`` is bag i's slide path where known.
    ``max_instances``: at most that many instances per bag, a random subset drawn anew each
    epoch (`set_epoch`, which reaches persistent DataLoader workers too) from ``seed``: the
    same on every run and every rank.
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
        bags: list[tuple[str, Path, str | None, str | None]] = []  # name, file, path, label
        if index is not None:
            opened = index if isinstance(index, SlideIndex) else SlideIndex.open(index)
            if split is not None:
                opened = opened.view(split=split)
            self.label_names = tuple(opened.slide_label_names)
            chosen = split_mask(opened.slides, opened.split)
            wanted = [sid for sid in range(len(opened.slides)) if chosen[sid]]
            # without features.json: the names extraction gives (a name's second slide gets
            # its id), never one file for two slides of the same name
            named = h5_file_names(opened, wanted)
            without: list[str] = []
            for sid in wanted:
                record = opened.slides[sid]
                file = by_path.get(record.path) or self.folder / named[sid]
                if file.is_file():
                    bags.append((file.stem, file, record.path, record.label))
                elif record.label is not None:
                    without.append(record.path)
        else:
            slide_of = {file: path for path, file in by_path.items()}
            by_name: dict[str, str] = {}
            if labels is not None:
                by_name = dict(labels) if isinstance(labels, Mapping) else _read_labels(labels)
                warn_similar(set(by_name.values()), "labels")
                warn_missing_spelt(list(by_name.values()))
            self.label_names = tuple(label_order(by_name.values()))
            # a file's slide name: from features.json, else the file's own name
            names = {
                file: slide_name(slide_of[file]) if file in slide_of else stem
                for stem, file in files.items()
            }
            for stem, file in files.items():
                bags.append((stem, file, slide_of.get(file), _label_of(file, names, by_name)))
            found = set(files) | set(names.values())
            without = sorted(set(by_name) - found)
        if without:  # extraction failed or has not run for them: say so, or they vanish
            shown = ", ".join(repr(n) for n in without[:5]) + (", ..." if len(without) > 5 else "")
            log.warning(
                "%d labelled slides have no feature file in %s, left out: %s",
                len(without),
                self.folder,
                shown,
            )
        if unlabelled == "drop":
            bags = [bag for bag in bags if bag[3] is not None]
        if not bags:
            raise InputError(
                "no feature files (<slide>.h5) for these slides in the folder", path=str(folder)
            )
        lookup = {name: i for i, name in enumerate(self.label_names)}
        self.slides = [name for name, *_ in bags]  # unique: the files' names
        self.files = [file for _, file, *_ in bags]
        self.paths = [path for _, _, path, _ in bags]  # the slides' paths, where known
        self.labels = np.array([lookup.get(label or "", -1) for *_, label in bags], np.int64)
        self.max_instances = max_instances
        self.seed = seed
        # shared memory: set_epoch reaches DataLoader workers that outlive an epoch
        # (persistent_workers), which hold a copy of this dataset made when they started
        self._epoch = torch.zeros((), dtype=torch.int64)
        self._epoch.share_memory_()  # type: ignore[no-untyped-call]

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Draw other instance subsets (``max_instances``) this epoch, in this process and in
        the DataLoader workers that hold a copy of this dataset."""
        self._epoch.fill_(int(epoch))

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


def _label_of(file: Path, names: Mapping[Path, str], by_name: Mapping[str, str]) -> str | None:
    """A file's label from labels by name: by its own name (``case-s1``) first, then by its
    slide's name (``names``), which must not be the slide name of another file as well: two
    slides named ``case`` in different folders, whose label for 'case' could be either's."""
    if file.stem in by_name:
        return by_name[file.stem]
    name = names[file]
    if name not in by_name:
        return None
    same = sorted(other.name for other, its in names.items() if its == name)
    if len(same) > 1:
        stems = ", ".join(Path(other).stem for other in same)
        raise InputError(
            f"the label of slide {name!r} fits {len(same)} feature files, of slides of that "
            f"name in different folders ({', '.join(same)}): give their labels by file name "
            f"({stems}), or pass index= to label the slides by path",
            path=str(file.parent),
        )
    return by_name[name]


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
