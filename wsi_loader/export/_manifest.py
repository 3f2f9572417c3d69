"""The rows of ``manifest.csv`` and ``failures.csv``: their columns, where a tile comes from and
its label (the fields every output format records of a tile), and the CSV writer.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from wsi_loader.files import csv_cell, write_file
from wsi_loader.index._table import SlideIndex

MANIFEST_COLUMNS = (
    "file",
    "member",
    "row",
    "slide_id",
    "slide_path",
    "x",
    "y",
    "level",
    "read_size",
    "tile_mpp",
    "label",
    "slide_label",
    "split",
    "sha256",
)
FAILURE_COLUMNS = ("row", "slide_id", "slide_path", "x", "y", "level", "reason")


def tile_label(index: SlideIndex, row: int) -> str | None:
    """The label of a tile by name: its annotated class (an index built with
    ``label_from="annotations"``), else its slide's label; None when it has none."""
    if not index.labels_from_annotations:
        return index.slides[int(index.columns["slide_id"][row])].label
    label_id = int(index.columns["tile_label"][row])
    return index.label_names[label_id] if label_id >= 0 else None


def tile_fields(index: SlideIndex, row: int) -> dict[str, Any]:
    """Where a tile comes from: the columns manifest.csv and failures.csv share."""
    cols = index.columns
    sid = int(cols["slide_id"][row])
    return {
        "row": row,
        "slide_id": sid,
        "slide_path": index.slides[sid].path,
        "x": int(cols["l0_x"][row]),
        "y": int(cols["l0_y"][row]),
        "level": int(cols["level"][row]),
    }


def write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    """The rows as a CSV file; text cells that a spreadsheet would run as formulas (a slide
    named ``=cmd|calc!A0``) are quoted by `csv_cell`."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: csv_cell(value) for key, value in row.items()} for row in rows)
    # a path that is not UTF-8 (see `file_text`) is written as the file system's own bytes
    write_file(path, buf.getvalue().encode("utf-8", "surrogateescape"))
