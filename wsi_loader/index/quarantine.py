"""The quarantine: failed reads, appended as JSON lines by whichever process hit them.

Two kinds of record:

* ``"kind": "tile"`` (the default of records written before kinds existed): one tile of a
  readable slide failed to read (``path``, ``x``, ``y``, ``level``, ``error``, ``fingerprint``);
* ``"kind": "slide"``: the whole slide was missing or unreadable (``path``, ``error``,
  ``fingerprint``), recorded once, not once per tile. Slide records never exclude tiles.

Tile records carry the fingerprint of the slide they were read from: a record of an older
version of a slide (rewritten since) no longer excludes its tiles.

Writers take an exclusive ``flock`` on ``quarantine.jsonl.lock`` and append each record with
one ``write`` (``O_APPEND``, never through a symlink), so records from several workers never
interleave, and `Quarantine.rewrite` (``--clear``, ``--retry``) can replace the file without
losing a concurrent append. A writer killed mid-record can leave a partial last line: the next
writer starts on a fresh line, and readers skip (and log) lines that do not parse or do not
hold valid values, so one bad record never hides the others.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.files import append_line, locked

log = logging.getLogger(__name__)

INT32 = 2**31


def _valid(entry: Any) -> bool:
    """A record whose fields have the types and ranges readers rely on."""
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        return False
    if entry.get("kind", "tile") == "slide":
        return True
    if entry.get("kind", "tile") != "tile":
        return False
    for key in ("x", "y"):
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not -INT32 <= value < INT32:
            return False
    fp = entry.get("fingerprint")
    return fp is None or isinstance(fp, str)


TileKey = tuple[str, "str | None", int, int]  # (path as stored, fingerprint, l0_x, l0_y)


def tile_key(record: dict[str, Any]) -> TileKey:
    """The identity of a tile record: the same tile of the same file."""
    return (str(record["path"]), record.get("fingerprint"), int(record["x"]), int(record["y"]))


class Quarantine:
    """Append-only failure log of one index directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._tiles: set[TileKey] | None = None  # recorded tiles, read at the first record_tile

    @staticmethod
    def _stamped(record: dict[str, Any]) -> dict[str, Any]:
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(), **record}

    def append(self, record: dict[str, Any]) -> None:
        """Append one tile record (at least ``slide_id``, ``path``, ``x``, ``y``, ``error``)."""
        with locked(self.lock_path):
            append_line(self.path, self._stamped({"kind": "tile", **record}))

    def append_slide(self, record: dict[str, Any]) -> bool:
        """Append a slide record (``path``, ``fingerprint``, ``error``) unless one for the same
        path and fingerprint is already there (from another worker); True when written."""
        with locked(self.lock_path):
            for old in self.slide_records():
                if old["path"] == record["path"] and old.get("fingerprint") == record.get(
                    "fingerprint"
                ):
                    return False
            append_line(self.path, self._stamped({**record, "kind": "slide"}))
            return True

    def record_tile(self, record: dict[str, Any]) -> bool:
        """`append` a tile record unless that tile is recorded already: in the file when this
        object first looked, or by this object since. A tile that fails every epoch, in each
        epoch's new workers, is recorded once. True when written."""
        if self._tiles is None:
            self._tiles = {
                tile_key(r)
                for r in self.read()
                if r.get("kind", "tile") == "tile" and {"path", "x", "y"} <= r.keys()
            }
        key = tile_key(record)
        if key in self._tiles:
            return False
        self.append(record)
        self._tiles.add(key)
        return True

    def read(self) -> list[dict[str, Any]]:
        """Every valid record, oldest first (torn or invalid lines are skipped with a warning)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        records = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line, parse_constant=_reject_constant)
            except (ValueError, RecursionError):
                log.warning(
                    "%s:%d: skipping a torn quarantine record (not valid JSON)", self.path, number
                )
                continue
            if not _valid(entry):
                log.warning("%s:%d: skipping an invalid quarantine record", self.path, number)
                continue
            records.append(entry)
        return records

    def tile_records(self) -> list[dict[str, Any]]:
        return [r for r in self.read() if r.get("kind", "tile") == "tile"]

    def slide_records(self) -> list[dict[str, Any]]:
        return [r for r in self.read() if r.get("kind") == "slide"]

    def rewrite(self, keep: Callable[[dict[str, Any]], bool]) -> tuple[int, int]:
        """Keep only the records ``keep`` accepts (atomically, under the writers' lock);
        returns (kept, removed). Invalid lines are dropped."""
        with locked(self.lock_path):
            records = self.read()
            kept = [r for r in records if keep(r)]
            if len(kept) == len(records) and self.path.exists():
                return len(kept), 0
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            with open(tmp, "w", encoding="utf-8") as fh:
                for record in kept:
                    fh.write(json.dumps(record, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            return len(kept), len(records) - len(kept)

    def keys(self, fingerprints: dict[str, str] | None = None) -> set[tuple[str, int, int]]:
        """(stored slide path, l0_x, l0_y) of every quarantined tile. With ``fingerprints``
        (stored path -> the slide's current fingerprint), records taken from another version
        of a slide are left out."""
        out = set()
        for entry in self.tile_records():
            path, recorded = entry["path"], entry.get("fingerprint")
            current = fingerprints.get(path) if fingerprints else None
            if recorded is not None and current is not None and recorded != current:
                continue
            out.add((path, int(entry["x"]), int(entry["y"])))
        return out

    def coords_by_path(
        self, fingerprints: dict[str, str] | None = None
    ) -> dict[str, set[tuple[int, int]]]:
        """Quarantined (l0_x, l0_y) per stored slide path (see `keys`)."""
        out: dict[str, set[tuple[int, int]]] = {}
        for path, x, y in self.keys(fingerprints):
            out.setdefault(path, set()).add((x, y))
        return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid number")


def coords_in(
    l0_x: npt.NDArray[np.integer[Any]],
    l0_y: npt.NDArray[np.integer[Any]],
    coords: set[tuple[int, int]],
) -> npt.NDArray[np.bool_]:
    """Boolean per tile: is (l0_x, l0_y) one of ``coords`` (int32 coordinates)."""
    if not coords or not len(l0_x):
        return np.zeros(len(l0_x), dtype=bool)
    wanted = np.array(
        [xy for xy in sorted(coords) if all(-INT32 <= v < INT32 for v in xy)], dtype=np.int64
    ).reshape(-1, 2)
    # one int64 key per (x, y): a sorted lookup, not a tiles x coords comparison matrix
    return np.isin(_xy_key(l0_x, l0_y), _xy_key(wanted[:, 0], wanted[:, 1]))


def _xy_key(x: npt.ArrayLike, y: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """A unique int64 per (x, y) pair of int32 coordinates."""
    return np.asarray(x, np.int64) * 2**32 + (np.asarray(y, np.int64) & 0xFFFFFFFF)
