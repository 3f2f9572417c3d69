"""What an index's files must agree on, checked once when a generation is opened.

An index is a folder anyone can edit, copy half of, or write with another tool. A column that
lies gives wrong results far from the cause: slide ids out of order read another slide's tiles
marked ok, positions off the slide read white tiles marked ok, a level out of range is an
IndexError in a worker, a huge window a 2.7 TiB allocation, a tile size of "big" a raw
ValueError. So the columns are checked against the slide table with bounds per slide (one
vectorised pass over each column, not a check per read), and every failure is an
`IndexFormatError` naming the file at fault and saying to rebuild.

Columns other than those checked here (QC, stain and later ones) pass as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import IndexFormatError
from wsi_loader.index._table_files import SlideRecord

Floats = npt.NDArray[np.float64]
MAX_TILE_SIZE = 16_384  # IndexConfig.tile_size's bound
REBUILD = "the index is corrupt or was edited: rebuild it"


def check_params(meta: Mapping[str, Any], gen: Path) -> None:
    """The build parameters readers use: ``tile_size``, the edge of every tile read."""
    params = meta.get("params")
    tile_size = params.get("tile_size") if isinstance(params, dict) else None
    if type(tile_size) is not int or not 1 <= tile_size <= MAX_TILE_SIZE:
        raise IndexFormatError(
            f"params.tile_size is {_short(tile_size)}, not a tile edge in pixels (an integer "
            f"1..{MAX_TILE_SIZE}); {REBUILD}",
            path=str(gen / "meta.json"),
        )


def check_values(columns: Mapping[str, npt.NDArray[Any]], slides: int, gen: Path) -> None:
    """Values every reader relies on: a slide id of the slide table, a positive window, a
    level >= 0 (a bad value would read black tiles marked ok, or fail far from its cause)."""
    if not len(columns["slide_id"]):
        return
    checks = (
        ("slide_id", 0, slides - 1, f"ids of the {slides} slides"),
        ("read_size", 1, None, "positive window sizes"),
        ("level", 0, None, "levels >= 0"),
    )
    for name, low, high, what in checks:
        column = columns[name]
        lo, hi = int(column.min()), int(column.max())
        if lo < low or (high is not None and hi > high):
            raise IndexFormatError(
                f"column {name!r} holds values {lo}..{hi}, not {what}; {REBUILD}",
                path=str(gen / f"{name}.npy"),
            )


def check_slides(
    columns: Mapping[str, npt.NDArray[Any]], slides: Sequence[SlideRecord], gen: Path
) -> None:
    """The tile columns against the slide table: each slide's tiles contiguous, as many as
    its record says, inside the slide, at its read level and window size; and each record's
    window inside its slide, at one of its levels. Runs after `check_values`."""
    slide_id = columns["slide_id"]
    if len(slide_id) > 1 and bool((slide_id[1:] < slide_id[:-1]).any()):
        raise IndexFormatError(
            f"column 'slide_id' is not sorted: the tiles of a slide must be contiguous; {REBUILD}",
            path=str(gen / "slide_id.npy"),
        )
    counts = np.bincount(slide_id, minlength=len(slides))
    listed = np.array([s.tiles for s in slides], dtype=np.int64)
    if (counts != listed).any():
        sid = int(np.flatnonzero(counts != listed)[0])
        raise IndexFormatError(
            f"column 'slide_id' gives {counts[sid]} tiles of slide {sid} "
            f"({slides[sid].path}) where slides.json says {listed[sid]}; {REBUILD}",
            path=str(gen / "slide_id.npy"),
        )
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    with_tiles = np.flatnonzero(counts > 0)
    first = np.array([slides[i].first_row for i in with_tiles.tolist()], dtype=np.int64)
    if (first != starts[with_tiles]).any():
        sid = int(with_tiles[np.flatnonzero(first != starts[with_tiles])[0]])
        raise IndexFormatError(
            f"slide {sid} ({slides[sid].path}) says its tiles start at row "
            f"{slides[sid].first_row}, the columns at row {starts[sid]}; {REBUILD}",
            path=str(gen / "slides.json"),
        )
    if not len(with_tiles):
        return
    for sid in with_tiles.tolist():
        _check_record(slides[sid], sid, gen)
    at = starts[with_tiles]

    def bounds(name: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        column = columns[name]  # per slide: contiguous rows, so one reduceat pass each
        return np.minimum.reduceat(column, at), np.maximum.reduceat(column, at)

    def expected(field: str) -> Floats:
        values = [getattr(slides[i], field) for i in with_tiles.tolist()]
        return np.array([np.nan if v is None else v for v in values], dtype=np.float64)

    def refuse(name: str, wrong: npt.NDArray[np.bool_], what: str, want: Floats) -> None:
        if not wrong.any():
            return
        k = int(np.flatnonzero(wrong)[0])
        sid = int(with_tiles[k])
        lo, hi = bounds(name)
        value = "none" if np.isnan(want[k]) else f"{want[k]:g}"
        raise IndexFormatError(
            f"column {name!r} holds {lo[k]}..{hi[k]} for slide {sid} ({slides[sid].path}), "
            f"{what.format(value)}; {REBUILD}",
            path=str(gen / f"{name}.npy"),
        )

    for name, field in (("level", "read_level"), ("read_size", "read_size")):
        lo, hi = bounds(name)
        want = expected(field)
        wrong = ~np.isnan(want) & ((lo != want) | (hi != want))
        what = "read level" if name == "level" else "window size"
        refuse(name, wrong, f"not the slide's {what} ({{}} in slides.json)", want)
    for name, field in (("l0_x", "width"), ("l0_y", "height")):
        lo, hi = bounds(name)
        size = expected(field)
        wrong = (lo < 0) | (~np.isnan(size) & (hi >= size))
        refuse(name, wrong, f"outside its slide (level-0 {field} {{}})", size)


def _check_record(slide: SlideRecord, sid: int, gen: Path) -> None:
    """One record's read plan against its slide: a level it has, a window that fits."""
    where = f"slide {sid} ({slide.path})"
    level, count = slide.read_level, slide.level_count
    if level is not None and count is not None and not 0 <= level < count:
        raise IndexFormatError(
            f"{where}: read level {level} of a slide with {count} levels; {REBUILD}",
            path=str(gen / "slides.json"),
        )
    size, width, height = slide.read_size, slide.width, slide.height
    if size is None or width is None or height is None:
        return
    downsample = slide.read_downsample or 1.0
    # a full window lies inside the level: its level-0 extent is the slide's at most (one
    # level pixel of rounding aside)
    if not 0 < downsample < 2**20 or (size - 1) * downsample > min(width, height):
        raise IndexFormatError(
            f"{where}: a window of {size} px at downsample {downsample:g} is larger than the "
            f"slide ({width} x {height}); {REBUILD}",
            path=str(gen / "slides.json"),
        )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
