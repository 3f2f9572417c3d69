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

from wsi_loader.errors import ConfigError
from wsi_loader.files import append_line, locked

log = logging.getLogger(__name__)

INT32 = 2**31
INT16 = 2**15  # the index's level column is int16


def _int(low: int, high: int) -> Callable[[Any], bool]:
    """A check for a JSON integer (not a bool, not a float) with ``low <= value < high``."""
    return lambda v: type(v) is int and low <= v < high


def _text(value: Any) -> bool:
    return isinstance(value, str)


# Every field some reader of the quarantine uses, and what it must hold (None: absent is
# fine). Tile records need ``x`` and ``y``; a record that fails a check is skipped whole.
_FIELDS: dict[str, Callable[[Any], bool]] = {
    "path": _text,
    "fingerprint": _text,
    "error": _text,
    "time": _text,
    "policy": _text,
    "pid": _int(0, 2**63),
    "slide_id": _int(0, INT32),
    "row": _int(0, 2**63),
    "x": _int(-INT32, INT32),
    "y": _int(-INT32, INT32),
    "level": _int(0, INT16),
}
_REQUIRED = {"tile": ("path", "x", "y"), "slide": ("path",)}


def invalid_field(entry: Any) -> str | None:
    """Why a parsed line is not a usable record (the field at fault and its value), or None
    when every field has the type and range its readers rely on."""
    if not isinstance(entry, dict):
        return "not an object"
    kind = entry.get("kind", "tile")
    if kind not in _REQUIRED:
        return f"kind: {kind!r} is not 'tile' or 'slide'"
    for key in _REQUIRED[kind]:
        if key not in entry:
            return f"{key}: missing"
    for key, check in _FIELDS.items():
        value = entry.get(key)
        if value is not None and not check(value):
            return f"{key}: {_short(value)} is out of range or of the wrong type"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


Coords = tuple[int, int, "int | None"]  # l0_x, l0_y, level (None: a record without one)
TileAt = tuple[str, int, int, "int | None"]  # the same, with the slide's path as stored
# (path as stored, fingerprint, l0_x, l0_y, level; None: a record that names no level)
TileKey = tuple[str, "str | None", int, int, "int | None"]


def tile_key(record: dict[str, Any]) -> TileKey:
    """The identity of a tile record: the same tile (position and level) of the same file."""
    level = record.get("level")
    return (
        str(record["path"]),
        record.get("fingerprint"),
        int(record["x"]),
        int(record["y"]),
        None if level is None else int(level),
    )


class Quarantine:
    """Append-only failure log of one index directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._tiles: set[TileKey] | None = None  # recorded tiles, read at the first record_tile
        self._slides = _SlideRecords()  # recorded slides, read as the file grows

    @staticmethod
    def _stamped(record: dict[str, Any]) -> dict[str, Any]:
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(), **record}

    def append(self, record: dict[str, Any]) -> None:
        """Append one tile record (at least ``slide_id``, ``path``, ``x``, ``y``, ``error``)."""
        with locked(self.lock_path):
            append_line(self.path, self._stamped({"kind": "tile", **record}))

    def append_slide(self, record: dict[str, Any]) -> bool:
        """Append a slide record (``path``, ``fingerprint``, ``error``) unless one for the same
        path and fingerprint is already there (from another worker); True when written.

        Each call reads only what was appended since this object's last call (the whole file
        again after a rewrite replaced it): when a mount disappears, every worker records
        every slide, and re-reading the file per record made that quadratic."""
        key = (str(record["path"]), record.get("fingerprint"))
        with locked(self.lock_path):
            if key in self._slides.update(self.path):
                return False
            append_line(self.path, self._stamped({**record, "kind": "slide"}))
            self._slides.keys.add(key)
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
            why = invalid_field(entry)
            if why is not None:
                log.warning(
                    "%s:%d: skipping an invalid quarantine record (%s)", self.path, number, why
                )
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

    def keys(self, fingerprints: dict[str, str] | None = None) -> set[TileAt]:
        """(stored slide path, l0_x, l0_y, level or None) of every quarantined tile. With
        ``fingerprints`` (stored path -> the slide's current fingerprint), records taken from
        another version of a slide are left out."""
        return set(self.reasons(fingerprints))

    def reasons(self, fingerprints: dict[str, str] | None = None) -> dict[TileAt, str]:
        """The recorded error of every quarantined tile (the last record of a tile), by the
        keys of `keys` (the same records left out)."""
        out: dict[TileAt, str] = {}
        for entry in self.tile_records():
            path, recorded = entry["path"], entry.get("fingerprint")
            current = fingerprints.get(path) if fingerprints else None
            if recorded is not None and current is not None and recorded != current:
                continue
            out[(path, *tile_key(entry)[2:])] = str(entry.get("error") or "")
        return out

    def coords_by_path(self, fingerprints: dict[str, str] | None = None) -> dict[str, set[Coords]]:
        """Quarantined (l0_x, l0_y, level or None) per stored slide path (see `keys`)."""
        out: dict[str, set[Coords]] = {}
        for path, x, y, level in self.keys(fingerprints):
            out.setdefault(path, set()).add((x, y, level))
        return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid number")


class _SlideRecords:
    """The (path, fingerprint) of the slide records of a quarantine file, kept up to date by
    reading only the bytes appended since the last look. A file replaced since (a rewrite:
    another inode) or shorter than what was read is read again from the start."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, str | None]] = set()
        self.file: tuple[int, int] | None = None  # (st_dev, st_ino) of the file read
        self.read_to = 0  # bytes of it parsed: whole lines only

    def update(self, path: Path) -> set[tuple[str, str | None]]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            self.keys, self.file, self.read_to = set(), None, 0
            return self.keys
        try:
            st = os.fstat(fd)
            if self.file != (st.st_dev, st.st_ino) or st.st_size < self.read_to:
                self.keys, self.file, self.read_to = set(), (st.st_dev, st.st_ino), 0
            data = os.pread(fd, st.st_size - self.read_to, self.read_to)
        finally:
            os.close(fd)
        whole = data.rfind(b"\n") + 1  # a torn last line is parsed once it is ended
        for line in data[:whole].splitlines():
            if b'"slide"' not in line:  # tile records: most lines, no parse needed
                continue
            try:
                entry = json.loads(line, parse_constant=_reject_constant)
            except (ValueError, RecursionError):
                continue  # read() says so
            if invalid_field(entry) is None and entry.get("kind") == "slide":
                self.keys.add((entry["path"], entry.get("fingerprint")))
        self.read_to += whole
        return self.keys


def coords_in(
    l0_x: npt.NDArray[np.integer[Any]],
    l0_y: npt.NDArray[np.integer[Any]],
    level: npt.NDArray[np.integer[Any]],
    coords: set[Coords],
) -> npt.NDArray[np.bool_]:
    """Boolean per tile: is (l0_x, l0_y, level) one of ``coords`` (int32 coordinates; a
    level of None matches the position at every level)."""
    found = np.zeros(len(l0_x), dtype=bool)
    if not coords or not len(l0_x):
        return found
    by_level: dict[int | None, list[tuple[int, int]]] = {}
    for x, y, at in coords:
        if -INT32 <= x < INT32 and -INT32 <= y < INT32:
            by_level.setdefault(at, []).append((x, y))
    tiles = _xy_key(l0_x, l0_y)
    levels = np.asarray(level)
    for at, positions in by_level.items():  # a few levels at most: one pass each
        wanted = np.array(sorted(positions), dtype=np.int64).reshape(-1, 2)
        # one int64 key per (x, y): a sorted lookup, not a tiles x coords comparison matrix
        hit = np.isin(tiles, _xy_key(wanted[:, 0], wanted[:, 1]))
        found |= hit if at is None else hit & (levels == at)
    return found


def _xy_key(x: npt.ArrayLike, y: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """A unique int64 per (x, y) pair of int32 coordinates."""
    return np.asarray(x, np.int64) * 2**32 + (np.asarray(y, np.int64) & 0xFFFFFFFF)


def quarantine_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a quarantine file: absolute (workers may start elsewhere), in a folder that
    exists (a share that is not mounted is an error now, not a warning per failed tile)."""
    file = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if file.is_dir():
        raise ConfigError(
            f"quarantine {str(file)!r} is a folder; name a file in it", key="quarantine", value=path
        )
    if not file.parent.is_dir():
        raise ConfigError(
            f"quarantine {str(file)!r}: the folder {str(file.parent)!r} does not exist",
            key="quarantine",
            value=path,
        )
    return file
