"""The files `predict` writes, in the layout WSInfer users know, and reading them back
(``inspect --predictions``, notebooks, the viewer)::

    DIR/model-outputs-csv/<slide>.csv          minx,miny,width,height,prob_<class>... (level-0 px)
    DIR/model-outputs-geojson/<slide>.geojson  each tile a QuPath "tile" object
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
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import InputError

CSV_FOLDER = "model-outputs-csv"
GEOJSON_FOLDER = "model-outputs-geojson"
HEATMAP_FOLDER = "heatmaps"
PREDICT_JSON = "predict.json"
SLIDES_CSV = "slides.csv"
METRICS_JSON = "metrics.json"
BOX_COLUMNS = ("minx", "miny", "width", "height")
PROB_PREFIX = "prob_"
MAX_CSV_BYTES = 2**31  # a slide's CSV is a few MB; more is not one of ours
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


# class colours (matplotlib's tab10): QuPath shows classes in them, and view.py draws labels
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

    def geojson_bytes(self, slide: str) -> bytes:
        """A FeatureCollection of QuPath tile objects (QuPath 0.4+ imports it by drag and
        drop): the tile's box, its probabilities as ``measurements`` and the most probable
        class as ``classification``. Ids are derived from the slide and the box (the same in
        every run)."""
        numbers = self._numbers()
        names = [json.dumps(PROB_PREFIX + c) for c in self.classes]  # quoted once, not per tile
        top = np.argmax(self.probabilities, axis=1).tolist() if len(self.boxes) else []
        classifications = [
            json.dumps({"name": c, "color": list(LABEL_PALETTE[i % len(LABEL_PALETTE)])})
            for i, c in enumerate(self.classes)
        ]
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
                f'"isLocked": true, "classification": {classifications[best]}, '
                f'"measurements": {{{measurements}}}}}}}'
            )
        body = ",\n".join(features)
        return f'{{"type": "FeatureCollection", "features": [\n{body}\n]}}\n'.encode()

    @classmethod
    def read_csv(cls, path: str | os.PathLike[str]) -> TilePredictions:
        """A slide's ``model-outputs-csv`` file (ours or WSInfer's); `InputError` names the
        file and the line at fault."""
        where = os.fspath(path)
        try:
            if os.stat(where).st_size > MAX_CSV_BYTES:
                raise InputError("too large for a model outputs CSV", path=where)
            with open(where, encoding="utf-8", newline="") as fh:
                rows = list(csv.reader(fh))
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read: {exc}", path=where) from exc
        if not rows:
            raise InputError("empty: expected a header minx,miny,width,height,prob_...", path=where)
        header = rows[0]
        if tuple(header[:4]) != BOX_COLUMNS:
            raise InputError(
                f"the header must start with {','.join(BOX_COLUMNS)}, got {','.join(header[:4])}",
                path=where,
                line=1,
            )
        prob = [i for i, name in enumerate(header) if name.startswith(PROB_PREFIX)]
        if not prob:
            raise InputError("no prob_<class> column", path=where, line=1)
        classes = tuple(header[i][len(PROB_PREFIX) :] for i in prob)
        boxes = np.zeros((len(rows) - 1, 4), dtype=np.int64)
        probabilities = np.zeros((len(rows) - 1, len(prob)), dtype=np.float32)
        for n, row in enumerate(rows[1:]):
            try:
                boxes[n] = [round(float(v)) for v in row[:4]]
                probabilities[n] = [float(row[i]) for i in prob]
            except (ValueError, IndexError) as exc:
                raise InputError(f"not a row of numbers: {exc}", path=where, line=n + 2) from None
        return cls(boxes, probabilities, classes)


def slide_files(out: Path, stem: str) -> dict[str, Path]:
    """The per-slide files of ``out`` for a slide whose file stem is ``stem``."""
    return {
        "csv": out / CSV_FOLDER / f"{stem}.csv",
        "geojson": out / GEOJSON_FOLDER / f"{stem}.geojson",
        "heatmap": out / HEATMAP_FOLDER / f"{stem}.png",
    }


def read_run(out: str | os.PathLike[str]) -> dict[str, object]:
    """``predict.json`` of a predictions folder; `InputError` when it is not one."""
    path = Path(out) / PREDICT_JSON
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InputError(
            "not a predictions folder (no predict.json): run wsi-loader predict first",
            path=str(out),
        ) from exc
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read: {exc}", path=str(path)) from exc
    if not isinstance(document, dict):
        raise InputError("not a predict.json (a JSON object)", path=str(path))
    return document
