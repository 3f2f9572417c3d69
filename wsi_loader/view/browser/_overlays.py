"""What the viewer draws over a slide, from the index's columns: the tile grid (label, status,
tissue, annotation class, QC columns), the failures of the quarantine, annotation outlines and
the tissue mask. Nothing per tile is an object: the grid goes to the page as packed columns,
which it paints into one small raster (one pixel per grid cell) drawn scaled.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import AnnotationError
from wsi_loader.index._analyses import recorded_tissue_mask
from wsi_loader.index._qc import RULES, built_thresholds
from wsi_loader.index._qc import flags as qc_flags
from wsi_loader.index._table import SlideIndex
from wsi_loader.index.annotations import read_regions
from wsi_loader.slides._base import SlideReader
from wsi_loader.view.browser._public import scrub

log = logging.getLogger(__name__)

STATUSES = ("ok", "quarantined", "substituted")  # status codes of the grid's `status` column
TISSUE_RGBA = (0, 170, 90, 120)  # the tissue mask's colour
QC_ORDER = ("pen", "fold", "bubble", "blur")  # a tile flagged by several shows the first


@dataclass(frozen=True)
class Failure:
    """A quarantined tile of a slide: where, what happened, and which policy applied."""

    x: int
    y: int
    level: int | None  # the level it was read at (None: a record that names none)
    status: str  # "quarantined" | "substituted"
    error: str


@dataclass
class Grid:
    """One slide's tiles as columns, in index row order, then quarantined tiles that are not
    rows (left out when the index was built); their ``row`` is -1. ``failures``: the records
    that apply to these tiles (at their level), by level-0 (x, y)."""

    columns: dict[str, npt.NDArray[Any]]
    footprint: float  # tile edge in level-0 pixels
    stride: float  # grid step in level-0 pixels
    failures: dict[tuple[int, int], Failure] = field(default_factory=dict)

    def packed(self) -> tuple[list[dict[str, Any]], bytes]:
        """The columns' layout (name, type, byte offset) and their bytes, little-endian; wider
        types first so every column sits at an offset its typed array can view."""
        order = sorted(self.columns, key=lambda n: -self.columns[n].dtype.itemsize)
        layout, parts, offset = [], [], 0
        for name in order:
            array = np.ascontiguousarray(self.columns[name]).astype(
                self.columns[name].dtype.newbyteorder("<"), copy=False
            )
            layout.append({"name": name, "type": _JS_TYPES[array.dtype.str[1:]], "offset": offset})
            parts.append(array.tobytes())
            offset += array.nbytes
        return layout, b"".join(parts)

    def at(self, l0_x: float, l0_y: float) -> int | None:
        """The position (in these columns) of the tile under a level-0 point: of those that
        contain it (tiles overlap when the stride is smaller than a tile), the one whose
        centre is nearest; None when no tile does."""
        x, y = self.columns["x"], self.columns["y"]
        inside = (
            (x <= l0_x) & (l0_x < x + self.footprint) & (y <= l0_y) & (l0_y < y + self.footprint)
        )
        hits = np.flatnonzero(inside)
        if not len(hits):
            return None
        half = self.footprint / 2
        distance = (x[hits] + half - l0_x) ** 2 + (y[hits] + half - l0_y) ** 2
        return int(hits[int(np.argmin(distance))])


_JS_TYPES = {"i4": "Int32", "f4": "Float32", "i2": "Int16", "u1": "Uint8"}


def qc_columns(index: SlideIndex) -> list[str]:
    """The index's QC columns (``qc_focus``, ``qc_pen``...), sorted."""
    return sorted(name for name in index.columns if name.startswith("qc_"))


def qc_rules(index: SlideIndex) -> list[dict[str, Any]]:
    """The QC rules the grid's ``qc`` column numbers from 1 (in `QC_ORDER`, as ``inspect
    --color-by qc`` colours them), with the thresholds the index was built with; empty for
    an index without QC columns."""
    if not all(rule.column in index.columns for rule in RULES.values()):
        return []
    limits = built_thresholds(index.params)
    return [
        {
            "name": name,
            "column": RULES[name].column,
            "threshold": limits[name],
            "below": RULES[name].below,
        }
        for name in QC_ORDER
    ]


def first_flags(index: SlideIndex, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    """Per row, 1 + the position in `QC_ORDER` of the first rule that flags it; 0: none."""
    first = np.zeros(len(rows), dtype=np.uint8)
    if not qc_rules(index):
        return first
    picked = {RULES[name].column: index.columns[RULES[name].column][rows] for name in QC_ORDER}
    flagged = qc_flags(picked, QC_ORDER, built_thresholds(index.params))
    for position, name in reversed(list(enumerate(QC_ORDER))):
        first[flagged[name]] = position + 1
    return first


def failures_of(index: SlideIndex, slide_id: int) -> list[Failure]:
    """The quarantine's tile records of this slide's indexed version, in the order written
    (a later record of a tile overrides an earlier one)."""
    record = index.slides[slide_id]
    found: list[Failure] = []
    quarantine = index.quarantine
    if quarantine.path.is_symlink():  # the index's own file only: never read through a link
        log.warning("%s is a symbolic link: its records are not shown", quarantine.path)
        return found
    for entry in quarantine.tile_records():
        if entry["path"] != record.path:
            continue
        fingerprint = entry.get("fingerprint")
        if fingerprint is not None and record.fingerprint and fingerprint != record.fingerprint:
            continue  # a record of another version of the file
        level = entry.get("level")
        status = "substituted" if entry.get("policy") == "substitute" else "quarantined"
        error = str(entry.get("error") or "no reason recorded")
        found.append(Failure(int(entry["x"]), int(entry["y"]), level, status, error))
    return found


def applicable(
    failures: list[Failure], levels: dict[tuple[int, int], int], read_level: int
) -> dict[tuple[int, int], Failure]:
    """The failures that are of the grid's tiles, by level-0 (x, y): a record matches a tile at
    its position and level (any level when it names none), as the dataset's quarantine mask
    matches them; a record where no tile is counts at the slide's read level."""
    found: dict[tuple[int, int], Failure] = {}
    for failure in failures:
        at = levels.get((failure.x, failure.y), read_level)
        if failure.level is None or failure.level == at:
            found[(failure.x, failure.y)] = failure
    return found


def grid_of(index: SlideIndex, slide_id: int) -> Grid:
    """The slide's grid columns: ``x``, ``y`` (level-0), ``row`` (index row, -1: not a row),
    ``label`` (tile label id, -1: none), ``status`` (position in `STATUSES`), ``tissue``,
    ``annotation`` and ``coverage`` (the class covering most of the tile and its share, with
    annotations), every ``qc_*`` column (as float32) and, with them, ``qc`` (the first rule
    that flags the tile: `first_flags`)."""
    record = index.slides[slide_id]
    starts = index.slide_starts()
    rows = np.arange(starts[slide_id], starts[slide_id + 1], dtype=np.int64)
    cols = index.columns
    x = np.asarray(cols["l0_x"][rows], dtype=np.int32)
    y = np.asarray(cols["l0_y"][rows], dtype=np.int32)
    levels = np.asarray(cols["level"][rows]).tolist()
    known = dict(zip(zip(x.tolist(), y.tolist(), strict=True), levels, strict=True))
    failures = applicable(failures_of(index, slide_id), known, record.read_level or 0)
    extra = [f for key, f in failures.items() if key not in known]
    n_extra = len(extra)

    def padded(values: npt.NDArray[Any], fill: float, dtype: Any) -> npt.NDArray[Any]:
        return np.concatenate([np.asarray(values, dtype=dtype), np.full(n_extra, fill, dtype)])

    columns: dict[str, npt.NDArray[Any]] = {
        "x": np.concatenate([x, np.array([f.x for f in extra], dtype=np.int32)]),
        "y": np.concatenate([y, np.array([f.y for f in extra], dtype=np.int32)]),
        "row": padded(rows, -1, np.int32),
        "label": padded(index.tile_labels(rows), -1, np.int16),
        "tissue": padded(cols["tissue"][rows], np.nan, np.float32),
    }
    status = np.zeros(len(columns["x"]), dtype=np.uint8)
    for i, (tx, ty) in enumerate(zip(columns["x"].tolist(), columns["y"].tolist(), strict=True)):
        failure = failures.get((tx, ty))
        if failure is not None:
            status[i] = STATUSES.index(failure.status)
    columns["status"] = status
    coverage = index.coverage
    if coverage is not None and coverage.shape[1]:
        shares = np.asarray(coverage[rows], dtype=np.float32)
        top = np.argmax(shares, axis=1)
        share = shares[np.arange(len(rows)), top]
        columns["annotation"] = padded(np.where(share > 0, top, -1), -1, np.int16)
        columns["coverage"] = padded(share, 0, np.float32)
    for name in qc_columns(index):
        columns[name] = padded(np.asarray(cols[name][rows], dtype=np.float32), np.nan, np.float32)
    if qc_rules(index):
        columns["qc"] = padded(first_flags(index, rows), 0, np.uint8)
    downsample = record.read_downsample or 1.0
    footprint = (record.read_size or 0) * downsample
    stride = (record.stride or record.read_size or 0) * downsample
    return Grid(columns, footprint, stride or footprint, failures)


def row_details(index: SlideIndex, grid: Grid, position: int) -> dict[str, Any]:
    """What the page shows of one tile: its row and everything the index knows of it."""
    cols = grid.columns
    x, y, row = int(cols["x"][position]), int(cols["y"][position]), int(cols["row"][position])
    label = int(cols["label"][position])
    failure = grid.failures.get((x, y))
    details: dict[str, Any] = {
        "row": row if row >= 0 else None,
        "x": x,
        "y": y,
        "footprint": grid.footprint,
        "label": index.label_names[label] if 0 <= label < len(index.label_names) else None,
        "tissue": _number(cols["tissue"][position]),
        "status": STATUSES[int(cols["status"][position])],
        "failure": scrub(failure.error) if failure else None,
    }
    if row >= 0:
        details["level"] = int(index.columns["level"][row])
        details["read_size"] = int(index.columns["read_size"][row])
        coverage = index.coverage
        if coverage is not None:
            details["coverage"] = {
                name: round(float(share), 4)
                for name, share in zip(index.classes, coverage[row], strict=True)
            }
    for name in qc_columns(index):
        details[name] = _number(cols[name][position])
    return details


def _number(value: Any) -> float | None:
    number = float(value)
    return None if math.isnan(number) else round(number, 4)


def annotation_rings(index: SlideIndex, slide_id: int) -> dict[str, Any]:
    """The outlines of the slide's annotation regions as flat level-0 point lists per class
    (holes included), or the error that keeps them from being read (``error``: the files
    changed since indexing)."""
    record = index.slides[slide_id]
    classes = list(index.classes)
    if not record.annotations:
        return {"classes": classes, "rings": []}
    try:
        objects = index.params.get("annotation_objects") or ()
        regions = read_regions(record.annotations, record.width, record.height, objects)
    except (AnnotationError, OSError) as exc:  # the caller says it (the page gets no path)
        return {"classes": classes, "rings": [], "error": exc}
    rings = []
    for name, geometry in regions.classes.items():
        if name not in classes:
            classes.append(name)
        for polygon in getattr(geometry, "geoms", [geometry]):
            if polygon.geom_type != "Polygon":
                continue
            for ring in [polygon.exterior, *polygon.interiors]:
                points = np.asarray(ring.coords, dtype=np.float64)[:, :2].round(1)
                rings.append({"class": classes.index(name), "points": points.ravel().tolist()})
    return {"classes": classes, "rings": rings}


class TissueMasks:
    """The tissue mask of a slide as the index found it (the detector recorded for the slide,
    on the same image: a fluorescence slide's glows, a user's mask image, an annotation
    class), as an RGBA picture: coloured where tissue, transparent elsewhere. A few are
    kept."""

    def __init__(self, index: SlideIndex, keep: int = 8) -> None:
        self.index = index
        self.keep = keep
        self._masks: dict[tuple[int, str], npt.NDArray[np.uint8]] = {}
        self._lock = threading.Lock()

    def rgba(self, slide_id: int, version: str, reader: SlideReader) -> npt.NDArray[np.uint8]:
        key = (slide_id, version)
        with self._lock:
            found = self._masks.get(key)
        if found is not None:
            return found
        record = self.index.slides[slide_id]
        mask = recorded_tissue_mask(reader, record, self.index.params)
        rgba = np.zeros((*mask.shape, 4), dtype=np.uint8)
        rgba[mask] = TISSUE_RGBA
        with self._lock:
            while len(self._masks) >= self.keep:
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = rgba
        return rgba
