"""List, clear and retry the quarantine of an index (`wsi-loader quarantine`).

Torch-free like the reader it uses. ``retry`` reads every quarantined tile again by its
recorded coordinates (a rebuild may have left it out of the index) and every slide-level
record's slide, and keeps only the records that still fail.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from wsi_loader.dataset._reading import TileReader
from wsi_loader.errors import SlideError, TileReadError
from wsi_loader.index._lookup import resolve_slide
from wsi_loader.index._table import SlideIndex

log = logging.getLogger(__name__)

Record = dict[str, Any]


def _identity(record: Record) -> tuple[Any, ...]:
    return tuple(record.get(k) for k in ("kind", "path", "x", "y", "time", "pid", "error"))


def _slide_path(index: SlideIndex, slide: str | None) -> str | None:
    """The stored path of the slide ``slide`` names (id, path, file name or stem)."""
    if slide is None:
        return None
    return index.slides[resolve_slide(index, slide)].path


def select(index: SlideIndex, slide: str | None = None) -> list[Record]:
    """The quarantine's records, of one slide when ``slide`` is given."""
    path = _slide_path(index, slide)
    return [r for r in index.quarantine.read() if path is None or r["path"] == path]


def clear(index: SlideIndex, slide: str | None = None) -> tuple[int, int]:
    """Remove every record (or one slide's); returns (kept, removed)."""
    path = _slide_path(index, slide)
    return index.quarantine.rewrite(lambda r: path is not None and r["path"] != path)


def retry(index: SlideIndex, slide: str | None = None, retries: int = 2) -> tuple[int, int]:
    """Read the quarantined tiles and slides again; remove the records that read fine now.
    Returns (still failing, cleared)."""
    by_path = {record.path: sid for sid, record in enumerate(index.slides)}
    reader = TileReader(
        index, on_error="fill", retries=retries, record_failures=False, report_failures=False
    )
    tile = np.empty((reader.tile_size, reader.tile_size, 3), dtype=np.uint8)
    fixed: set[tuple[Any, ...]] = set()
    try:
        for record in select(index, slide):
            sid = by_path.get(record["path"])
            if sid is None:
                continue  # a slide no longer in the index: leave its records alone
            current = index.slides[sid]
            stale = record.get("fingerprint") not in (None, current.fingerprint)
            if stale:  # recorded on an older version of the slide
                fixed.add(_identity(record))
                continue
            level = record.get("level")
            level = (current.read_level or 0) if level is None else level
            if record.get("kind") != "slide" and level >= (current.level_count or 1):
                log.warning(
                    "%s: a quarantined tile at level %d, which the slide lacks (levels 0..%d): "
                    "left as it is",
                    record["path"],
                    level,
                    (current.level_count or 1) - 1,
                )
                continue
            try:
                if record.get("kind") == "slide":
                    reader.get_reader(sid)
                else:
                    size = int(current.read_size or reader.tile_size)
                    reader.read_window(sid, int(record["x"]), int(record["y"]), level, size, tile)
            except (TileReadError, SlideError) as exc:
                log.info("still failing: %s: %s", record["path"], exc)
                continue
            fixed.add(_identity(record))
    finally:
        reader.close()
    kept, removed = index.quarantine.rewrite(lambda r: _identity(r) not in fixed)
    return kept, removed
