"""The image-folder layout: a folder per label (the class ids torchvision's ImageFolder and
Hugging Face's imagefolder read from the folders' sorted names) and each tile's file in it;
for an index with splits exported whole, a folder per split above them
(``DIR/<split>/<label>/``, which both read split by split).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from wsi_loader.export._manifest import tile_label
from wsi_loader.index._labels import label_order
from wsi_loader.index._naming import safe_component
from wsi_loader.index._table import SlideIndex


def label_folders(
    labels: Sequence[str | None], order: Sequence[str] | None = None
) -> dict[str, str]:
    """Folder per label (None, no label, has none); labels that sanitise to the same name get
    a short hash suffix. ``order`` is the labels' id order (the index's label names;
    `label_order` by default). When the folders' sorted order (which torchvision's
    ImageFolder and Hugging Face's ClassLabel turn into class ids) differs from it (sanitised
    names, numbers: '10' < '2' as text), every folder gets its rank as a prefix, so the ids
    stay the index's."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    present = {lb for lb in labels if lb is not None}
    ranked = [lb for lb in order or () if lb in present]
    ranked += label_order(present - set(ranked))
    for label in ranked:
        folder = safe_component(label)
        if folder in taken:
            folder = f"{folder}-{hashlib.sha256(label.encode()).hexdigest()[:8]}"
        out[label] = folder
        taken.add(folder)
    if sorted(ranked, key=lambda lb: out[lb]) != ranked:
        width = len(str(len(ranked)))
        out.update({lb: f"{k:0{width}d}-{out[lb]}" for k, lb in enumerate(ranked)})
    return out


def image_file(
    index: SlideIndex,
    row: int,
    out: Path,
    folders: dict[str, str],
    unlabelled_out: str | None,
    ext: str,
    splits: dict[str, str] | None = None,
) -> Path:
    """The file of a tile in an image-folder export: in its label's folder of ``out``
    (``folders``, `label_folders`), under its slide's split folder when given ``splits``
    (`split_folders`), or in ``unlabelled_out`` when it has no label."""
    cols = index.columns
    # no slide name in it: Hugging Face's imagefolder reads "train", "val", "test"...
    # between separators in a file name as a split (Camelyon16's test_001), and a name
    # of letters s, x, y, digits and '_' holds no word
    sid = int(cols["slide_id"][row])
    name = f"s{sid:05d}_x{int(cols['l0_x'][row])}_y{int(cols['l0_y'][row])}.{ext}"
    label = tile_label(index, row)
    if label is None:  # the plan holds such tiles only with unlabelled_out
        assert unlabelled_out is not None
        return Path(unlabelled_out) / name
    if splits is not None:
        out = out / splits[index.slides[sid].split or ""]
    return out / folders[label] / name


UNASSIGNED = "unassigned"  # the split folder of slides without a split


def split_folders(index: SlideIndex) -> dict[str, str]:
    """Split name ("" for slides without one) -> its folder, for an index with splits that
    is exported whole; empty for an index without splits, or a view of one split."""
    names = index.splits()
    if index.split is not None or not names:
        return {}
    folders: dict[str, str] = {}
    for name in names:
        folder = safe_component(name)
        if folder in folders.values():  # two names that sanitise alike
            folder = f"{folder}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
        folders[name] = folder
    if any(s.split is None and s.status == "ok" and s.tiles for s in index.slides):
        folders[""] = UNASSIGNED if UNASSIGNED not in folders.values() else f"_{UNASSIGNED}"
    return folders
