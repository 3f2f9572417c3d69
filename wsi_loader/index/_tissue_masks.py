"""Tissue masks given by the user: images matched to slides by name.

``tissue_masks`` names a folder (searched recursively), one image, or a CSV with ``path`` or
``slide`` and a ``mask`` column (images relative to the CSV). In a folder an image matches
slide ``a.svs`` when its name, without the image suffix, is ``a``, ``a.svs``, or ``a`` with a
``_mask``, ``-mask`` or ``.mask`` ending (``a.png``, ``a_mask.tif``, ``a.svs.png``). One image
and one slide match whatever their names.

A mask is any image (PNG, TIFF, JPEG, BMP, WebP, GIF) with the slide's aspect ratio, at any
size: pixels brighter than mid-grey (after conversion to grey) are tissue. Masks are
untrusted files: one over `MAX_MASK_PIXELS` is refused before it is decoded, and a mask that
cannot be read or does not fit its slide fails that slide with the reason.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from wsi_loader.errors import InputError
from wsi_loader.index._csv_tables import read_csv_rows
from wsi_loader.index._inputs import (
    SlideEntry,
    name_cell,
    path_or_name,
    slide_name,
)
from wsi_loader.index._tissue import BoolArray

MASK_SUFFIXES = (".png", ".tif", ".tiff", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
MASK_ENDINGS = ("", "_mask", "-mask", ".mask")
MAX_MASK_PIXELS = 64_000_000  # 8k x 8k: far finer than any tissue mask needs
ASPECT_TOLERANCE = 0.02  # mask and slide aspect ratios may differ this much (rounding)


@dataclass
class MaskReport:
    """Masks that matched no slide, and slides without a mask (they use the detector)."""

    unmatched_files: list[str] = field(default_factory=list)
    slides_without: list[str] = field(default_factory=list)


def match_masks(entries: list[SlideEntry], source: str) -> tuple[dict[str, str], MaskReport]:
    """The mask image of each slide path that has one, and the report."""
    report = MaskReport()
    found: dict[str, str] = {}
    if source.lower().endswith(".csv") and os.path.isfile(source):
        found = _from_csv(entries, source, report)
    elif os.path.isfile(source) and len(entries) == 1:
        found = {entries[0].path: os.path.abspath(source)}
    elif os.path.isdir(source) or os.path.isfile(source):
        files = _mask_files(source) if os.path.isdir(source) else [os.path.abspath(source)]
        found = _by_name(entries, files, report)
    else:
        raise InputError(
            "the tissue masks path does not exist (a folder of mask images, one image, or a "
            "CSV with path|slide and mask columns)",
            path=source,
        )
    report.slides_without = [e.path for e in entries if e.path not in found]
    if not found:
        raise InputError(
            "no tissue mask matches any slide (a mask of 'a.svs' is named 'a.png', "
            "'a_mask.png', 'a.svs.png'..., or listed in a CSV's 'mask' column); nothing was "
            "written",
            path=source,
        )
    return found, report


def _mask_files(folder: str) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(
            os.path.abspath(os.path.join(dirpath, f))
            for f in sorted(filenames)
            if not f.startswith(".") and f.lower().endswith(MASK_SUFFIXES)
        )
    return found


def _by_name(entries: list[SlideEntry], files: list[str], report: MaskReport) -> dict[str, str]:
    by_stem: dict[str, list[str]] = {}
    for file in files:
        by_stem.setdefault(Path(file).stem, []).append(file)
    found: dict[str, str] = {}
    used: set[str] = set()
    for entry in entries:
        names = (slide_name(entry.path), os.path.basename(entry.path))
        mine = sorted({f for n in names for end in MASK_ENDINGS for f in by_stem.get(n + end, [])})
        if len(mine) > 1:
            raise InputError(
                f"several tissue masks match slide {os.path.basename(entry.path)}: "
                f"{', '.join(os.path.basename(m) for m in mine)}; keep one",
                path=os.path.dirname(mine[0]),
            )
        if mine:
            found[entry.path] = mine[0]
            used.add(mine[0])
    report.unmatched_files = [f for f in files if f not in used]
    return found


def _from_csv(entries: list[SlideEntry], table: str, report: MaskReport) -> dict[str, str]:
    folder = os.path.dirname(os.path.abspath(table))
    by_path: dict[str, str] = {}
    by_name: dict[str, str] = {}
    for line, row in read_csv_rows(table, ["path", "slide"], ("path", "slide", "mask")):
        if not row.get("mask"):
            raise InputError(
                "a tissue masks table needs a 'mask' in every row", path=table, line=line
            )
        _, mask = path_or_name(folder, row["mask"], table, line)
        if row.get("path"):
            kind, key = path_or_name(folder, row["path"], table, line)
            (by_path if kind == "path" else by_name)[key] = mask
        elif row.get("slide"):
            by_name[name_cell(row["slide"])] = mask
        else:
            raise InputError("a row needs 'path' or 'slide'", path=table, line=line)
    found: dict[str, str] = {}
    used: set[str] = set()
    for entry in entries:
        key = entry.path if entry.path in by_path else slide_name(entry.path)
        hit = by_path.get(entry.path) or by_name.get(slide_name(entry.path))
        if hit:
            found[entry.path] = hit
            used.add(key)
    report.unmatched_files = [
        mask for key, mask in [*by_path.items(), *by_name.items()] if key not in used
    ]
    return found


def read_mask(path: str, l0_size: tuple[int, int]) -> BoolArray:
    """A user's mask image as a boolean array (True: tissue), checked against the slide's
    level-0 size (same aspect ratio). Raises `InputError` naming the file and the problem."""
    try:
        with warnings.catch_warnings():  # PIL warns of large images; we refuse them below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(path)
        with image:
            width, height = image.size
            if width * height > MAX_MASK_PIXELS:
                raise InputError(
                    f"the tissue mask is {width}x{height} px, more than the "
                    f"{MAX_MASK_PIXELS:,} pixels allowed; save it smaller (masks need not "
                    "be finer than the slide's thumbnail)",
                    path=path,
                )
            grey = np.asarray(image.convert("L"))
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ValueError) as exc:
        raise InputError(f"cannot read the tissue mask: {exc}", path=path) from exc
    expected = width * l0_size[1] / l0_size[0]
    if abs(height - expected) > max(1.0, ASPECT_TOLERANCE * expected):
        raise InputError(
            f"the tissue mask is {width}x{height} px but the slide is {l0_size[0]}x"
            f"{l0_size[1]}: their aspect ratios differ, so the mask does not cover the slide",
            path=path,
        )
    mask: BoolArray = grey > 127
    return mask
