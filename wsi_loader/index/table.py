"""The on-disk slide index: a slide table plus memory-mapped numpy tile columns.

Layout of an index directory::

    DIR/CURRENT              name of the live generation, replaced atomically
    DIR/gen-000003/meta.json schema_version, build parameters, counts, label names, root
    DIR/gen-000003/slides.json one record per slide (slide id = position)
    DIR/gen-000003/<column>.npy one array per tile column (see TILE_COLUMNS)
    DIR/quarantine.jsonl     failed tile reads appended by datasets (outlives generations)

A build writes a new generation under a temporary name, renames it, then swaps ``CURRENT``:
a build killed at any point leaves the previous index readable. Tiles of one slide are
contiguous (``SlideRecord.first_row``), in row-major grid order.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import IndexFormatError
from wsi_loader.index.quarantine import Quarantine, coords_in

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
CURRENT = "CURRENT"

# name -> dtype of every tile column; all have one row per tile.
TILE_COLUMNS: dict[str, np.dtype[Any]] = {
    "slide_id": np.dtype(np.int32),  # position in the slide table
    "l0_x": np.dtype(np.int32),  # level-0 top-left x
    "l0_y": np.dtype(np.int32),  # level-0 top-left y
    "level": np.dtype(np.int16),  # read level
    "read_size": np.dtype(np.int32),  # window edge in read-level pixels (l_w == l_h)
    "tissue": np.dtype(np.float32),  # tissue fraction from the mask, 0..1
}


@dataclass(frozen=True)
class SlideRecord:
    """One row of the slide table. ``path`` is as stored: relative to the root when there is one."""

    path: str
    status: str = "ok"  # "ok" | "failed"
    error: str | None = None
    warning: str | None = None
    label: str | None = None
    split: str | None = None
    size: int | None = None
    mtime_ns: int | None = None
    fingerprint: str | None = None
    backend: str | None = None
    vendor: str | None = None
    width: int | None = None
    height: int | None = None
    level_count: int | None = None
    mpp: float | None = None
    mpp_source: str | None = None
    objective_power: float | None = None
    read_level: int | None = None
    read_downsample: float | None = None
    read_size: int | None = None
    stride: int | None = None  # grid step in read-level pixels
    tile_mpp: float | None = None
    aligned: bool | None = None
    mask_level: int | None = None
    tiles: int = 0
    first_row: int = 0

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SlideRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


TileArrays = dict[str, npt.NDArray[Any]]


@dataclass
class SlideIndex:
    """A read-only view of an index directory. Tile columns are memory-mapped numpy arrays.

    ``len(index)`` is the number of tiles; ``index.columns[name]`` one column; ``index.slides``
    the slide table in slide-id order.
    """

    path: Path
    meta: dict[str, Any]
    slides: tuple[SlideRecord, ...]
    columns: TileArrays
    root: str | None = None
    excluded: int = 0  # quarantined tiles left out when opened with exclude_quarantined
    label_names: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        root: str | None = None,
        exclude_quarantined: bool = False,
    ) -> SlideIndex:
        """Open an index directory.

        ``root`` remaps where relative slide paths live (an index moved with its archive).
        ``exclude_quarantined`` leaves out tiles recorded in the quarantine.
        """
        base = Path(path)
        return cls._open_generation(base, _current_generation(base), root, exclude_quarantined)

    @classmethod
    def _open_generation(
        cls, base: Path, gen: Path, root: str | None, exclude_quarantined: bool
    ) -> SlideIndex:
        if not gen.is_dir():
            raise IndexFormatError("the index generation no longer exists", path=str(gen))
        try:
            meta = json.loads((gen / "meta.json").read_text(encoding="utf-8"))
            slides_json = json.loads((gen / "slides.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise IndexFormatError(f"unreadable index metadata: {exc}", path=str(gen)) from exc
        version = meta.get("schema_version")
        if version != SCHEMA_VERSION:
            raise IndexFormatError(
                f"schema_version {version!r} is not supported (this wsi_loader reads "
                f"{SCHEMA_VERSION}); rebuild the index",
                path=str(base),
            )
        columns: TileArrays = {}
        for name, dtype in TILE_COLUMNS.items():
            file = gen / f"{name}.npy"
            try:
                array = np.load(file, mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise IndexFormatError(
                    f"unreadable column {name!r}: {exc}", path=str(file)
                ) from exc
            if array.dtype != dtype or array.ndim != 1 or len(array) != meta["tiles_total"]:
                raise IndexFormatError(
                    f"column {name!r} has dtype {array.dtype}, shape {array.shape}; expected "
                    f"{dtype} with {meta['tiles_total']} rows",
                    path=str(file),
                )
            columns[name] = array
        slides = tuple(SlideRecord.from_json(s) for s in slides_json)
        index = cls(
            path=base,
            meta=meta,
            slides=slides,
            columns=columns,
            root=root if root is not None else meta.get("root"),
            label_names=tuple(meta.get("label_names", ())),
        )
        if exclude_quarantined:
            drop = index.quarantined_mask()
            index.excluded = int(drop.sum())
            if index.excluded:
                index.columns = {
                    name: np.ascontiguousarray(col[~drop]) for name, col in index.columns.items()
                }
        return index

    def slide_starts(self) -> npt.NDArray[np.int64]:
        """First row of every slide plus the end (tiles of a slide are contiguous), so slide
        ``s`` owns rows ``starts[s]:starts[s + 1]``; valid after quarantine exclusion too."""
        starts = np.searchsorted(self.columns["slide_id"], np.arange(len(self.slides) + 1))
        return starts.astype(np.int64)

    def quarantined_mask(self) -> npt.NDArray[np.bool_]:
        """Boolean per row: is this tile in the quarantine (matched by slide path, x, y)."""
        by_path = self.quarantine.coords_by_path()
        mask = np.zeros(len(self), dtype=bool)
        if not by_path:
            return mask
        starts = self.slide_starts()
        for sid, record in enumerate(self.slides):
            coords = by_path.get(record.path)
            if coords:
                rows = slice(int(starts[sid]), int(starts[sid + 1]))
                mask[rows] = coords_in(
                    self.columns["l0_x"][rows], self.columns["l0_y"][rows], coords
                )
        return mask

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without tile data: the receiver memory-maps the same generation again.

        Columns filtered by ``exclude_quarantined`` are in memory and travel as they are, so a
        worker never sees a different tile set than its parent.
        """
        state = dict(self.__dict__)
        if not self.excluded:
            state["columns"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.columns is None:
            gen = self.path / str(self.meta["generation"])
            fresh = SlideIndex._open_generation(self.path, gen, self.root, False)
            self.columns = fresh.columns

    def __len__(self) -> int:
        return len(self.columns["slide_id"])

    @property
    def schema_version(self) -> int:
        return int(self.meta["schema_version"])

    @property
    def params(self) -> dict[str, Any]:
        """The build parameters (the validated `IndexConfig`, as a dict)."""
        return dict(self.meta["params"])

    @property
    def quarantine(self) -> Quarantine:
        return Quarantine(self.path / "quarantine.jsonl")

    def slide_path(self, slide_id: int) -> str:
        """Absolute path of a slide, with the root (or its remapping) applied."""
        stored = self.slides[slide_id].path
        if os.path.isabs(stored) or self.root is None:
            return stored
        return os.path.join(self.root, stored)

    def slide_labels(self) -> npt.NDArray[np.int64]:
        """Label id per slide (position in ``label_names``), -1 when unlabelled."""
        lookup = {name: i for i, name in enumerate(self.label_names)}
        return np.array(
            [lookup.get(s.label, -1) if s.label is not None else -1 for s in self.slides],
            dtype=np.int64,
        )

    def summary(self) -> dict[str, Any]:
        """The JSON object `wsi-loader info --json` prints."""
        return {
            "path": str(self.path),
            "schema_version": self.schema_version,
            "generation": self.meta.get("generation"),
            "created": self.meta.get("created"),
            "params": self.params,
            "root": self.root,
            "tiles": int(sum(s.tiles for s in self.slides if s.status == "ok")),
            "label_names": list(self.label_names),
            "slides": [
                {
                    "slide_id": i,
                    "path": s.path,
                    "status": s.status,
                    "error": s.error,
                    "warning": s.warning,
                    "tiles": s.tiles,
                    "mpp": s.mpp,
                    "mpp_source": s.mpp_source,
                    "tile_mpp": s.tile_mpp,
                    "read_level": s.read_level,
                    "read_size": s.read_size,
                    "label": s.label,
                    "split": s.split,
                    "backend": s.backend,
                    "vendor": s.vendor,
                    "width": s.width,
                    "height": s.height,
                }
                for i, s in enumerate(self.slides)
            ],
            "quarantined": self.quarantine.read(),
        }


def _current_generation(base: Path) -> Path:
    pointer = base / CURRENT
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise IndexFormatError("not an index directory (no CURRENT file)", path=str(base)) from None
    except OSError as exc:
        raise IndexFormatError(f"cannot read {CURRENT}: {exc.strerror}", path=str(base)) from exc
    gen = base / name
    if not name.startswith("gen-") or "/" in name or not gen.is_dir():
        raise IndexFormatError(f"CURRENT names a missing generation {name!r}", path=str(base))
    return gen


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index(
    out: str | os.PathLike[str],
    slides: Sequence[SlideRecord],
    tiles: Sequence[TileArrays],
    params: Mapping[str, Any],
    root: str | None,
) -> SlideIndex:
    """Write a new generation atomically. ``tiles[i]`` holds slide i's columns (any length)."""
    base = Path(out)
    base.mkdir(parents=True, exist_ok=True)
    previous = None
    if (base / CURRENT).exists():
        previous = _current_generation(base).name
    number = int(previous.split("-")[1]) + 1 if previous else 1
    name = f"gen-{number:06d}"
    tmp = base / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()

    records, first = [], 0
    for record, arrays in zip(slides, tiles, strict=True):
        count = len(arrays["l0_x"]) if arrays else 0
        records.append(asdict(record) | {"tiles": count, "first_row": first})
        first += count
    labels = sorted({r["label"] for r in records if r["label"] is not None and r["status"] == "ok"})
    for col, dtype in TILE_COLUMNS.items():
        parts = [np.asarray(t[col], dtype=dtype) for t in tiles if t]
        array = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        with open(tmp / f"{col}.npy", "wb") as fh:
            np.save(fh, array)
            fh.flush()
            os.fsync(fh.fileno())
    meta = {
        "schema_version": SCHEMA_VERSION,
        "generation": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "params": dict(params),
        "root": root,
        "slides_total": len(records),
        "tiles_total": first,
        "label_names": labels,
        "columns": {k: str(v) for k, v in TILE_COLUMNS.items()},
    }
    for file, payload in (("slides.json", records), ("meta.json", meta)):
        with open(tmp / file, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    os.rename(tmp, base / name)
    pointer_tmp = base / f".{CURRENT}.tmp-{os.getpid()}"
    pointer_tmp.write_text(name + "\n", encoding="utf-8")
    os.replace(pointer_tmp, base / CURRENT)
    _fsync_dir(base)
    _remove_stale(base, keep=name)
    return SlideIndex.open(base)


def _remove_stale(base: Path, keep: str) -> None:
    """Delete older generations and leftovers of killed builds (open mmaps stay valid)."""
    for entry in base.iterdir():
        if entry.name == keep or not entry.is_dir():
            continue
        if entry.name.startswith("gen-") or entry.name.startswith(".gen-"):
            shutil.rmtree(entry, ignore_errors=True)


def split_tiles(index: SlideIndex, slide_id: int) -> TileArrays:
    """Copy one slide's rows out of an index (used to carry unchanged slides over)."""
    record = index.slides[slide_id]
    rows = slice(record.first_row, record.first_row + record.tiles)
    return {name: np.array(col[rows]) for name, col in index.columns.items()}


def records_by_path(index: SlideIndex) -> dict[str, tuple[int, SlideRecord]]:
    return {r.path: (i, r) for i, r in enumerate(index.slides)}
