"""The files `predict` writes, in the layout WSInfer users know, and reading them back
(``inspect --predictions``, notebooks, the viewer)::

    DIR/model-outputs-csv/<slide>.csv          minx,miny,width,height,prob_<class>... (level-0 px)
    DIR/model-outputs-geojson/<slide>.json     each tile a QuPath "tile" object (GeoJSON)
    DIR/heatmaps/<slide>.png                   the probabilities over the thumbnail
    DIR/slides.csv, DIR/metrics.json           slide-level results (`wsi_loader.predict`)
    DIR/predict.json                           run metadata: model, classes, counts, failures

Probabilities are written as float32's shortest exact decimal (``0.93124``), the same in the
CSV and the GeoJSON, so a rerun writes the same bytes.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import InputError
from wsi_loader.slides._base import NOT_REGULAR, open_regular

CSV_FOLDER = "model-outputs-csv"
GEOJSON_FOLDER = "model-outputs-geojson"
HEATMAP_FOLDER = "heatmaps"
# WSInfer names a slide's GeoJSON <slide>.json, and tools that read its layout look for that
# name; runs before this one wrote <slide>.geojson (removed when the slide is written again)
GEOJSON_SUFFIX = ".json"
OLD_GEOJSON_SUFFIX = ".geojson"
PREDICT_JSON = "predict.json"
SLIDES_CSV = "slides.csv"
METRICS_JSON = "metrics.json"
BOX_COLUMNS = ("minx", "miny", "width", "height")
PROB_PREFIX = "prob_"
MAX_CSV_BYTES = 2**31  # a slide's CSV is a few MB; more is not one of ours
MAX_RUN_BYTES = 64 * 2**20  # predict.json: a few hundred bytes a slide
_IDS = uuid.UUID("5b0c3c6e-6f1e-4d0e-9c1a-40d5a1e0c0de")  # namespace of tile object ids


def tile_id(name: str) -> str:
    """``str(uuid.uuid5(_IDS, name))``, without building a UUID object (a third of the time
    of writing a tile's GeoJSON): SHA-1 of the namespace and the name, version 5, RFC 4122
    variant."""
    digest = bytearray(hashlib.sha1(_IDS.bytes + name.encode(), usedforsecurity=False).digest())
    digest[6] = (digest[6] & 0x0F) | 0x50
    digest[8] = (digest[8] & 0x3F) | 0x80
    h = digest[:16].hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# class colours (matplotlib's tab10): QuPath shows classes in them; view/_notebook.py draws labels
LABEL_PALETTE = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
]


@dataclass
class TilePredictions:
    """One slide's tile outputs: ``boxes`` (N x 4 int64: minx, miny, width, height, level-0
    pixels) and ``probabilities`` (N x C float32, one column per name in ``classes``)."""

    boxes: npt.NDArray[np.int64]
    probabilities: npt.NDArray[np.float32]
    classes: tuple[str, ...]
    _text: list[list[str]] | None = field(default=None, init=False, repr=False, compare=False)

    def csv_bytes(self) -> bytes:
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow([*BOX_COLUMNS, *(PROB_PREFIX + c for c in self.classes)])
        for box, probs in zip(self.boxes.tolist(), self._numbers(), strict=True):
            writer.writerow([*box, *probs])
        return text.getvalue().encode("utf-8")

    def _numbers(self) -> list[list[str]]:
        """The probabilities as float32's shortest exact decimals (the CSV and the GeoJSON
        write the same text; converted once)."""
        if self._text is None:
            self._text = self.probabilities.astype(np.float32).astype(str).tolist()
        return self._text

    def geojson_bytes(self, slide: str, *, threshold: float | None = None) -> bytes:
        """A FeatureCollection of QuPath tile objects (QuPath 0.4+ imports it by drag and
        drop): the tile's box, its probabilities as ``measurements`` and the most probable
        class as ``classification``. ``threshold`` (a model of one output): the class when its
        probability is at or above it, else no classification (an argmax over one class
        would call every tile that class). Ids are derived from the slide and the box (the
        same in every run)."""
        numbers = self._numbers()
        names = [json.dumps(PROB_PREFIX + c) for c in self.classes]  # quoted once, not per tile
        top = np.argmax(self.probabilities, axis=1).tolist() if len(self.boxes) else []
        classifications = [
            ', "classification": '
            + json.dumps({"name": c, "color": list(LABEL_PALETTE[i % len(LABEL_PALETTE)])})
            for i, c in enumerate(self.classes)
        ]
        if threshold is not None and len(self.classes) == 1 and len(self.boxes):
            below = (self.probabilities[:, 0] < threshold).tolist()
            classifications.append("")  # no classification
            top = [1 if low else 0 for low in below]
        features = []
        for (x, y, w, h), probs, best in zip(self.boxes.tolist(), numbers, top, strict=True):
            # the ring as json.dumps writes a list of [x, y] pairs of ints
            ring = (
                f"[[{x + w}, {y}], [{x + w}, {y + h}], [{x}, {y + h}], [{x}, {y}], [{x + w}, {y}]]"
            )
            measurements = ", ".join(f"{n}: {p}" for n, p in zip(names, probs, strict=True))
            ident = tile_id(f"{slide}\0{x}\0{y}\0{w}\0{h}")
            features.append(
                f'{{"type": "Feature", "id": "{ident}", "geometry": {{"type": "Polygon", '
                f'"coordinates": [{ring}]}}, "properties": {{"objectType": "tile", '
                f'"isLocked": true{classifications[best]}, '
                f'"measurements": {{{measurements}}}}}}}'
            )
        body = ",\n".join(features)
        return f'{{"type": "FeatureCollection", "features": [\n{body}\n]}}\n'.encode()

    @classmethod
    def read_csv(
        cls,
        path: str | os.PathLike[str],
        *,
        follow_symlinks: bool = True,
        max_bytes: int = MAX_CSV_BYTES,
    ) -> TilePredictions:
        """A slide's ``model-outputs-csv`` file (ours or WSInfer's): the box columns and the
        ``prob_<class>`` columns in any order, other columns ignored, a UTF-8 BOM allowed,
        blank lines skipped. Every value must be a finite number, every probability in [0, 1]
        and every box non-empty (the error names the line and the column);
        boxes are rounded to whole level-0 pixels. `InputError` names the file (and the line)
        at fault; a header alone is a table of no tiles. ``follow_symlinks=False`` (the
        viewer, serving files of a folder to the network) refuses a symlink and anything but
        a regular file; OSError is raised as it is."""
        where = os.fspath(path)
        text = _read_text(where, follow_symlinks, max_bytes, "a model outputs CSV")
        reader = csv.reader(io.StringIO(text))
        header = [name.strip() for name in next(reader, [])]
        missing = [name for name in BOX_COLUMNS if name not in header]
        prob_columns = [name for name in header if name.startswith(PROB_PREFIX)]
        if missing or not prob_columns:
            raise InputError(
                f"a prediction table needs the columns {', '.join(BOX_COLUMNS)} and "
                f"prob_<class>; missing {', '.join(missing) or 'prob_ columns'}",
                path=where,
                line=1,
            )
        names = [*BOX_COLUMNS, *prob_columns]
        wanted = [header.index(name) for name in names]
        values = []
        for number, fields in enumerate(reader, start=2):
            if not fields:
                continue
            try:
                row = [float(fields[i]) for i in wanted]
            except (ValueError, IndexError):
                raise InputError(
                    "a row whose boxes or probabilities are not numbers", path=where, line=number
                ) from None
            bad = _bad_value(row, names)
            if bad:
                raise InputError(bad, path=where, line=number)
            values.append(row)
        table = np.array(values, dtype=np.float64).reshape(len(values), 4 + len(prob_columns))
        return cls(
            np.rint(table[:, :4]).astype(np.int64),
            table[:, 4:].astype(np.float32),
            tuple(name[len(PROB_PREFIX) :] for name in prob_columns),
        )


def _bad_value(row: list[float], names: list[str]) -> str | None:
    """What is wrong with one row of a prediction table (box columns, then probabilities),
    naming the column; None when nothing is. A NaN drawn into a heatmap would spoil the
    cumulative sums, and a probability of 7.5 or -3 is no probability."""
    for name, value in zip(names, row, strict=True):
        if not math.isfinite(value):
            return f"column {name}: {value} is not a finite number"
        if name.startswith(PROB_PREFIX) and not 0 <= value <= 1:
            return f"column {name}: {value:g} is not a probability (0 to 1)"
    for name, value in zip(names[2:4], row[2:4], strict=True):
        if value <= 0:
            return f"column {name}: a box that is empty ({value:g} px)"
    return None


def _read_text(where: str, follow_symlinks: bool, max_bytes: int, what: str) -> str:
    """A file's UTF-8 text (BOM dropped), refused when larger than ``max_bytes``; without
    ``follow_symlinks``, a symlink is an OSError. Opened by the slides' `open_regular`: only a
    regular file (a FIFO would block a reader, a device would never end)."""
    try:
        fd = open_regular(where, follow_symlinks=follow_symlinks)
    except OSError as exc:
        if exc.strerror == NOT_REGULAR:
            raise InputError("not a regular file", path=where) from None
        if not follow_symlinks:
            raise
        raise InputError(f"cannot read: {exc.strerror or exc}", path=where) from exc
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if info.st_size > max_bytes:
            raise InputError(f"{info.st_size} bytes: too large for {what}", path=where)
        raw = fh.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text ({exc.reason})", path=where) from None


def slide_files(out: Path, stem: str) -> dict[str, Path]:
    """The per-slide files of ``out`` for a slide whose file stem is ``stem``."""
    return {
        "csv": out / CSV_FOLDER / f"{stem}.csv",
        "geojson": out / GEOJSON_FOLDER / f"{stem}{GEOJSON_SUFFIX}",
        "heatmap": out / HEATMAP_FOLDER / f"{stem}.png",
    }


def read_run(out: str | os.PathLike[str], *, follow_symlinks: bool = True) -> dict[str, object]:
    """``predict.json`` of a predictions folder; `InputError` when it is not one.
    ``follow_symlinks=False`` (the viewer): opened as `TilePredictions.read_csv` opens a CSV
    then, and a missing file is FileNotFoundError (a folder of WSInfer's has none)."""
    path = Path(out) / PREDICT_JSON
    if follow_symlinks and not path.exists():
        raise InputError(
            "not a predictions folder (no predict.json): run wsi-loader predict first",
            path=str(out),
        )
    text = _read_text(str(path), follow_symlinks, MAX_RUN_BYTES, "a predict.json")
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise InputError(f"not the JSON predict writes: {exc}", path=str(path)) from None
    if not isinstance(document, dict):
        raise InputError("not a predict.json (a JSON object)", path=str(path))
    return document


def slide_stems(run: dict[str, object], out: str | os.PathLike[str]) -> dict[str, str]:
    """The file stem of each slide path of a ``predict.json`` (``slides``: path -> {"name":
    stem}), each checked to be a file name: one that could leave its folder, or a record
    without one, is an `InputError` (guessing by name could show one slide's predictions on
    another)."""
    where = str(Path(out) / PREDICT_JSON)
    slides = run.get("slides", {})
    if not isinstance(slides, dict):
        raise InputError("'slides' is not an object of slide paths", path=where)
    stems = {}
    for slide, entry in slides.items():
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise InputError(f"slide {slide!r} has no file name", path=where)
        if not name or name in (".", "..") or "/" in name or "\0" in name or name[0] == ".":
            raise InputError(f"slide {slide!r}: not a file name: {name!r}", path=where)
        stems[slide] = name
    return stems
