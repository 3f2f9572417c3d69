"""Names of the files outputs write, derived from slide names and labels: shared by the export,
feature and prediction writers. None of them can escape its folder or hide a file."""

from __future__ import annotations

import os
import re

from wsi_loader.index._inputs import slide_name
from wsi_loader.index._table import SlideIndex


def safe_component(name: str, max_length: int = 100) -> str:
    """A path component that cannot escape its folder: only ``[A-Za-z0-9._-]``, no leading dot."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name).lstrip(".")[:max_length]
    return cleaned or "_"


def key_component(name: str, max_length: int = 60) -> str:
    """A dot-free, readable name for WebDataset keys and file stems: WebDataset splits a
    member name at its first dot, so a slide named ``TCGA-...-DX1.0F7CE5A0-4D1C`` would merge
    all its tiles into one sample."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "_", name)[:max_length].strip("_")
    return cleaned or "_"


def file_text(value: str) -> str | bytes:
    """``value`` for an HDF5 string attribute: as it is, or, for a slide path that is not
    UTF-8 (a Latin-1 name from an old share, which Python holds as lone surrogates), its
    bytes as the file system has them, which UTF-8 text cannot hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(value)
    return value


def h5_file_names(index: SlideIndex, slide_ids: list[int]) -> dict[int, str]:
    """``<slide name>.h5`` per slide, as CLAM and TRIDENT name them (the file stem; the folder
    for DICOM); a name taken twice gets the slide id."""
    names: dict[int, str] = {}
    taken: set[str] = set()
    for sid in slide_ids:
        name = slide_name(index.slides[sid].path)
        # the exact name (spaces, accents): CLAM looks for <slide name>.h5, so a sanitised
        # name is a slide it never finds; only names that could escape or hide are changed
        unsafe = name in ("", ".", "..") or name.startswith(".") or "/" in name or "\0" in name
        stem = safe_component(name, 200) if unsafe or len(os.fsencode(name)) > 200 else name
        if stem in taken:
            stem = f"{stem}-s{sid}"
        taken.add(stem)
        names[sid] = f"{stem}.h5"
    return names


def bag_stem(name: str) -> str:
    """The file stem of a MIL output (attention CSV, heatmap) for a feature bag's slide name
    (`FeatureBagDataset` names bags by their h5 stems, file names already)."""
    return name.replace(os.sep, "_")
