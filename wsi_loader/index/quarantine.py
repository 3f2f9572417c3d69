"""The quarantine: failed tile reads, appended as JSON lines by whichever process hit them.

Each record is written with one ``write`` on a file opened ``O_APPEND`` under an exclusive
``flock``, so records from several workers never interleave. A writer killed mid-record can
leave a partial last line: the next writer starts on a fresh line, and readers skip (and log)
lines that do not parse, so one torn record never hides the others.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)


class Quarantine:
    """Append-only failure log of one index directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        """Append one record (at least ``slide_id``, ``path``, ``x``, ``y``, ``error``)."""
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(), **record}
        line = (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # a torn record from a killed writer: start afresh
            os.write(fd, line)
        finally:
            os.close(fd)  # closing releases the lock

    def read(self) -> list[dict[str, Any]]:
        """Every well-formed record, oldest first."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        records = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                log.warning("%s:%d: skipping a torn quarantine record", self.path, number)
                continue
            if isinstance(entry, dict):
                records.append(entry)
        return records

    def keys(self) -> set[tuple[str, int, int]]:
        """(stored slide path, l0_x, l0_y) of every quarantined tile."""
        out = set()
        for entry in self.read():
            try:
                out.add((str(entry["path"]), int(entry["x"]), int(entry["y"])))
            except (KeyError, TypeError, ValueError):
                continue
        return out

    def coords_by_path(self) -> dict[str, set[tuple[int, int]]]:
        """Quarantined (l0_x, l0_y) per stored slide path."""
        out: dict[str, set[tuple[int, int]]] = {}
        for path, x, y in self.keys():
            out.setdefault(path, set()).add((x, y))
        return out


def coords_in(
    l0_x: npt.NDArray[np.integer[Any]],
    l0_y: npt.NDArray[np.integer[Any]],
    coords: set[tuple[int, int]],
) -> npt.NDArray[np.bool_]:
    """Boolean per tile: is (l0_x, l0_y) one of ``coords``."""
    if not coords or not len(l0_x):
        return np.zeros(len(l0_x), dtype=bool)
    wanted = np.array(sorted(coords), dtype=np.int64).reshape(-1, 2)
    wanted = wanted[(np.abs(wanted) < 2**31).all(axis=1)]  # tile columns are int32
    # one int64 key per (x, y): a sorted lookup, not a tiles x coords comparison matrix
    return np.isin(_xy_key(l0_x, l0_y), _xy_key(wanted[:, 0], wanted[:, 1]))


def _xy_key(x: npt.ArrayLike, y: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """A unique int64 per (x, y) pair of int32 coordinates."""
    return np.asarray(x, np.int64) * 2**32 + (np.asarray(y, np.int64) & 0xFFFFFFFF)
