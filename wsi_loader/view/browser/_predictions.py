"""Prediction heatmaps from the output of ``wsi-loader predict``: ``DIR/model-outputs-csv/<slide
name>.csv``, one row per tile with ``minx, miny, width, height`` (level-0 pixels) and a
``prob_<class>`` column per class (the layout WSInfer writes).

The folder is listed once; a slide's file is found in that listing by name (never by a path
made from a request), opened without following symlinks and only when it is a regular file.
Every value is checked: a file that is not such a table is said in the page, naming the file
and the line.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import InputError
from wsi_loader.index._inputs import slide_name
from wsi_loader.index._naming import safe_component
from wsi_loader.predict._outputs import (
    CSV_FOLDER,
    PREDICT_JSON,
    TilePredictions,
    read_run,
    slide_stems,
)

MAX_FILE_BYTES = 512 * 2**20  # a table bigger than this is not a tile table
MAX_SPAN = 16  # lattice cells a box may cover along an edge (stride >= tile / 16)
MAX_CELLS = 64 * 2**20  # heatmap pixels (level-0 area / stride^2)
# viridis at 0, 0.25, 0.5, 0.75, 1 (as the static overviews colour tissue)
RAMP = np.array(
    [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)], dtype=np.float32
)


@dataclass(frozen=True)
class PredictionTable:
    """One slide's predictions: boxes (level-0) and a probability per class."""

    path: str
    classes: tuple[str, ...]
    boxes: npt.NDArray[np.float64]  # (n, 4): minx, miny, width, height
    probs: npt.NDArray[np.float32]  # (n, classes)

    def heatmap(self, class_index: int) -> tuple[npt.NDArray[np.uint8], tuple[float, ...]]:
        """An RGBA picture with one pixel per cell of the lattice the box corners lie on,
        coloured by the mean probability of class ``class_index`` over the boxes covering the
        cell (an overlapping grid, stride below the tile size, gives a smooth map, as
        ``predict``'s heatmaps), transparent where no box is; and the level-0 rectangle it
        covers (x, y, width, height). A box covers the cells wholly inside it, so no cell is
        coloured beyond the boxes (`overlaps` says whether boxes share cells)."""
        x, y = self.boxes[:, 0], self.boxes[:, 1]
        step_x, step_y = self.steps
        col = np.rint((x - x.min()) / step_x).astype(np.int64)
        row = np.rint((y - y.min()) / step_y).astype(np.int64)
        # cells a box covers: the whole steps of its edge (1 on a grid without overlap, never
        # a cell reaching past the box), bounded so a box far larger than the lattice step
        # cannot make the picture huge
        span_x = np.clip(np.floor(self.boxes[:, 2] / step_x + 1e-6), 1, MAX_SPAN).astype(np.int64)
        span_y = np.clip(np.floor(self.boxes[:, 3] / step_y + 1e-6), 1, MAX_SPAN).astype(np.int64)
        width, height = int((col + span_x).max()), int((row + span_y).max())
        if width * height > MAX_CELLS:
            raise InputError(
                f"boxes spread over {width} x {height} lattice cells: not a tile grid",
                path=self.path,
            )
        total = np.zeros((height, width), dtype=np.float64)
        count = np.zeros((height, width), dtype=np.int64)
        values = np.nan_to_num(self.probs[:, class_index].astype(np.float64), nan=0.0)
        for dy in range(int(span_y.max())):
            for dx in range(int(span_x.max())):
                use = (dy < span_y) & (dx < span_x)
                np.add.at(total, (row[use] + dy, col[use] + dx), values[use])
                np.add.at(count, (row[use] + dy, col[use] + dx), 1)
        covered = count > 0
        picture = np.zeros((height, width, 4), dtype=np.uint8)
        mean = (total[covered] / count[covered]).astype(np.float32)
        picture[covered, :3] = ramp_colours(mean)
        picture[covered, 3] = 255
        return picture, (float(x.min()), float(y.min()), width * step_x, height * step_y)

    @property
    def overlaps(self) -> bool:
        """Whether the boxes overlap (a grid with a stride below the tile size): the page then
        smooths the map between cells, within the cells boxes cover."""
        b = self.boxes
        step_x, step_y = self.steps
        return bool(np.median(b[:, 2]) > 1.01 * step_x or np.median(b[:, 3]) > 1.01 * step_y)

    @cached_property
    def steps(self) -> tuple[float, float]:
        """The lattice steps of the box corners in x and y (`_step`), found once per table:
        a heatmap request wants them for the picture and again for `overlaps`."""
        b = self.boxes
        return _step(b[:, 0], float(np.median(b[:, 2]))), _step(b[:, 1], float(np.median(b[:, 3])))

    def at(self, l0_x: float, l0_y: float) -> dict[str, float] | None:
        """The probabilities of the box under a level-0 point: of those that contain it (boxes
        overlap on grids with a stride below the tile size), the one whose centre is nearest,
        the rule the viewer's grid picks the clicked tile by; None when no box does."""
        b = self.boxes
        inside = (b[:, 0] <= l0_x) & (l0_x < b[:, 0] + b[:, 2])
        inside &= (b[:, 1] <= l0_y) & (l0_y < b[:, 1] + b[:, 3])
        hits = np.flatnonzero(inside)
        if not len(hits):
            return None
        centre_x = b[hits, 0] + b[hits, 2] / 2
        centre_y = b[hits, 1] + b[hits, 3] / 2
        nearest = hits[int(np.argmin((centre_x - l0_x) ** 2 + (centre_y - l0_y) ** 2))]
        return {
            name: round(float(p), 4)
            for name, p in zip(self.classes, self.probs[nearest], strict=True)
        }


def ramp_colours(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """RGB of values in [0, 1] on the viridis ramp."""
    pos = np.clip(np.nan_to_num(values, nan=0.0), 0.0, 1.0) * (len(RAMP) - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, len(RAMP) - 1)
    mix = (pos - lo)[:, None]
    rgb = RAMP[lo] + (RAMP[hi] - RAMP[lo]) * mix
    return np.rint(rgb).astype(np.uint8)


def _step(starts: npt.NDArray[np.float64], fallback: float) -> float:
    """The lattice step of box corners: the smallest gap between distinct corners."""
    gaps = np.diff(np.unique(starts))
    gaps = gaps[gaps > 0.5]
    step = float(gaps.min()) if len(gaps) else fallback
    return step if step > 0 and math.isfinite(step) else 1.0


def read_table(path: str) -> PredictionTable:
    """One prediction CSV, read by predict's own reader without following symlinks (raises
    `InputError` naming the file and line, or OSError); a table of no tiles is refused here,
    having nothing to draw."""
    tiles = TilePredictions.read_csv(path, follow_symlinks=False, max_bytes=MAX_FILE_BYTES)
    if not len(tiles.boxes):
        raise InputError("no rows", path=path)
    return PredictionTable(path, tiles.classes, tiles.boxes.astype(np.float64), tiles.probabilities)


class Predictions:
    """The prediction tables of a ``predict`` output folder, by slide (a few kept parsed)."""

    def __init__(self, folder: str | os.PathLike[str], keep: int = 8) -> None:
        self.folder = Path(folder)
        tables = self.folder / CSV_FOLDER
        if not tables.is_dir():
            raise InputError(
                f"no {CSV_FOLDER}/ folder: not the output of wsi-loader predict", path=str(folder)
            )
        self.files: dict[str, str] = {}
        with os.scandir(tables) as entries:
            for entry in entries:
                if entry.name.endswith(".csv") and entry.is_file(follow_symlinks=False):
                    self.files[entry.name[: -len(".csv")]] = entry.path
        self.names = _names_by_path(self.folder / PREDICT_JSON)
        self.keep = keep
        self._tables: dict[str, PredictionTable | InputError] = {}
        self._lock = threading.Lock()

    def file_for(self, slide_path: str, slide_id: int) -> str | None:
        """The listed file of a slide (``slide_path`` as the index stores it): the name
        ``predict.json`` gives the slide (two slides of one name in different folders are
        ``case`` and ``case-s<id>``); without one (WSInfer's folders), by the slide's name,
        its file-safe name, or either with the slide id appended."""
        if slide_path in self.names:
            return self.files.get(self.names[slide_path])
        name = slide_name(slide_path)
        for stem in (name, safe_component(name, 200), f"{name}-s{slide_id}"):
            if stem in self.files:
                return self.files[stem]
        return None

    def table(self, slide_path: str, slide_id: int) -> PredictionTable | None:
        """The slide's predictions (None without a file); raises `InputError` or OSError for
        a file that cannot be used."""
        path = self.file_for(slide_path, slide_id)
        if path is None:
            return None
        with self._lock:
            found = self._tables.get(path)
        if found is None:
            try:
                found = read_table(path)
            except InputError as exc:
                found = exc
            with self._lock:
                while len(self._tables) >= self.keep:
                    self._tables.pop(next(iter(self._tables)))
                self._tables[path] = found
        if isinstance(found, InputError):
            raise found
        return found


def _names_by_path(path: Path) -> dict[str, str]:
    """``predict.json``'s file stem of each slide path (`slide_stems`); empty when there is
    no such file. A file that is there but not such a record is said (`InputError`)."""
    try:
        run = read_run(path.parent, follow_symlinks=False)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=str(path)) from None
    return slide_stems(run, path.parent)
