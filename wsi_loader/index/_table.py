"""The on-disk slide index: a slide table plus memory-mapped numpy tile columns.

Layout of an index directory::

    DIR/CURRENT              name of the live generation, replaced atomically
    DIR/gen-000003/meta.json schema_version, build parameters, counts, label names, root
    DIR/gen-000003/slides.json one record per slide (slide id = position)
    DIR/gen-000003/<column>.npy one array per tile column (see TILE_COLUMNS)
    DIR/gen-000003/readers.lock every process using the generation holds a shared flock on it
    DIR/quarantine.jsonl     failed reads appended by datasets (outlives generations)

A build writes a new generation under a temporary name, renames it, then swaps ``CURRENT``:
a build killed at any point leaves the previous index readable. Older generations are deleted
only when no process holds their ``readers.lock``, so a dataset pickled to a worker (which
reopens its generation by name) keeps working across an in-place rebuild. Tiles of one slide
are contiguous (``SlideRecord.first_row``), in row-major grid order.

A `SlideIndex` may be a *view*: rows of one split, without quarantined tiles or without some
slides (`SlideIndex.view`). Slide ids stay those of the generation; ``source_rows`` maps each
row of the view back to its row in the generation.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import ConfigError, IndexFormatError
from wsi_loader.files import expand_home, lock
from wsi_loader.index._checks import check_params, check_slides, check_values
from wsi_loader.index._qc import (
    QC_COLUMNS,
    QcFilter,
    built_thresholds,
    excluded_counts,
    qc_totals,
    slide_summary,
)
from wsi_loader.index._qc import counts as qc_counts
from wsi_loader.index._quarantine import Quarantine, coords_in
from wsi_loader.index._stain_estimates import summary as stain_summary
from wsi_loader.slides.storage._sources import is_url, url_join

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
CURRENT = "CURRENT"
READERS_LOCK = "readers.lock"

# name -> dtype of every tile column; all have one row per tile.
TILE_COLUMNS: dict[str, np.dtype[Any]] = {
    "slide_id": np.dtype(np.int32),  # position in the slide table
    "l0_x": np.dtype(np.int32),  # level-0 top-left x
    "l0_y": np.dtype(np.int32),  # level-0 top-left y
    "level": np.dtype(np.int16),  # read level
    "read_size": np.dtype(np.int32),  # window edge in read-level pixels (l_w == l_h)
    "tissue": np.dtype(np.float32),  # tissue fraction from the mask, 0..1
}
# Columns of annotated indexes only (built with annotations).
OPTIONAL_COLUMNS: dict[str, np.dtype[Any]] = {
    # (tiles, classes): share of the tile each class of meta["annotation_classes"] covers
    "coverage": np.dtype(np.float32),
    # label id (position in label_names) from the annotations, -1 when none
    "tile_label": np.dtype(np.int32),
    # quality control (index/qc.py): qc_focus, qc_pen, qc_fold, qc_bubble, qc_background
    **QC_COLUMNS,
}


@dataclass(frozen=True)
class SlideRecord:
    """One row of the slide table. ``path`` is as stored: relative to the root when there is one."""

    path: str
    status: str = "ok"  # "ok" | "failed"
    error: str | None = None  # why a failed slide could not be indexed
    warning: str | None = None  # notes on an ok slide (repaired annotations, excluded tiles...)
    label: str | None = None  # from the manifest or labels CSV
    split: str | None = None  # train / val / test..., from the same
    size: int | None = None  # bytes (a DICOM series: all its files)
    mtime_ns: int | None = None  # newest modification time of its files
    fingerprint: str | None = None  # names, sizes, mtimes and head/tail bytes (identify)
    content: str | None = None  # size and head/tail digest, without name or mtime (content_key)
    backend: str | None = None  # "openslide" | "tiff": the reader that indexed it
    vendor: str | None = None  # OpenSlide's vendor name, or the TIFF flavour
    width: int | None = None  # level-0 pixels
    height: int | None = None
    level_count: int | None = None  # pyramid levels the reader sees
    mpp: float | None = None  # level-0 microns per pixel as used
    mpp_source: str | None = None  # where mpp came from (vendor, manifest, tiff-resolution...)
    objective_power: float | None = None
    read_level: int | None = None  # the level tiles are read from
    read_downsample: float | None = None  # that level's downsample from level 0
    read_size: int | None = None  # window edge read, in read-level pixels
    stride: int | None = None  # grid step in read-level pixels
    tile_mpp: float | None = None  # the resolution tiles are delivered at
    tile_mag: float | None = None  # their magnification (objective power / downsample, or 10/mpp)
    mag_source: str | None = None  # how tile_mag was found: "objective-power" or "mpp"
    aligned: bool | None = None  # grid starts on storage-tile corners
    mask_level: int | None = None  # the level the tissue mask was computed on
    tiles: int = 0
    first_row: int = 0
    excluded: int = 0  # quarantined tiles left out when this slide was indexed
    annotations: list[str] | None = None  # annotation files of the slide (absolute paths)
    annotation_digest: str | None = None  # of their contents: changed files re-index the slide
    class_areas: dict[str, float] | None = None  # annotated class -> level-0 area (px^2)
    # from the tissue of the low-resolution image (index/stain.py): H and E optical-density
    # vectors, max concentrations, LAB moments; or why there is no estimate (stain_error)
    stain: dict[str, Any] | None = None
    stain_error: str | None = None
    tissue_detector: str | None = None  # brightfield | fluorescence | mask | annotation
    tissue_reason: str | None = None  # why that detector (what the picture looked like)
    tissue_mask: str | None = None  # the user's mask image (tissue_masks)
    tissue_mask_digest: str | None = None  # of its contents: a changed mask re-indexes
    qc: dict[str, Any] | None = None  # quality-control summary (index/qc.py), excluded counts

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SlideRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


TileArrays = dict[str, npt.NDArray[Any]]
# a row filter: the columns (name -> array) in, one bool per row out
Where = Callable[[Mapping[str, npt.NDArray[Any]]], npt.ArrayLike]


def mapped(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A plain ndarray view of a memory-mapped column: the same file mapping, without
    np.memmap's per-indexing overhead (~10 us per element lookup on the per-tile path)."""
    return array.view(np.ndarray)


class GenerationLock:
    """A shared ``flock`` on a generation's ``readers.lock``, held while this object lives.

    Builds delete an old generation only when they can take the lock exclusively. Views and
    forked children share the descriptor (flock belongs to the open file description), and a
    process that unpickles an index takes its own. Generations written before the lock file
    existed have none: nothing is held and rebuilds delete them as before.
    """

    def __init__(self, gen: Path) -> None:
        self.fd: int | None = None
        try:
            self.fd = os.open(gen / READERS_LOCK, os.O_RDONLY)
        except FileNotFoundError:
            return
        lock(self.fd, fcntl.LOCK_SH, gen / READERS_LOCK)

    def __del__(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _unused(gen: Path) -> bool:
    """True when no process holds ``gen``'s readers lock (or it has none)."""
    try:
        fd = os.open(gen / READERS_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, gen / READERS_LOCK)  # no locks: no way to know
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@dataclass
class SlideIndex:
    """A read-only view of an index directory. Tile columns are memory-mapped numpy arrays.

    ``len(index)`` is the number of tiles; ``index.columns[name]`` one column; ``index.slides``
    the slide table in slide-id order. ``label_names`` name the ids of a tile's ``label``:
    its slide's label, or its annotated class when built with ``label_from="annotations"``
    (``slide_label_names`` always name the slide labels); ``classes`` are the annotation
    classes, the columns of ``coverage``.
    """

    path: Path
    meta: dict[str, Any]
    slides: tuple[SlideRecord, ...]
    columns: TileArrays
    root: str | None = None
    excluded: int = 0  # quarantined tiles left out when opened with exclude_quarantined
    filtered: int = 0  # rows left out by a ``where``
    label_names: tuple[str, ...] = field(default_factory=tuple)
    slide_label_names: tuple[str, ...] = field(default_factory=tuple)
    classes: tuple[str, ...] = field(default_factory=tuple)
    split: str | None = None  # the split this view holds (None: every slide)
    dropped_slides: tuple[int, ...] = ()  # slides left out of this view (missing, unlabelled)
    source_rows: npt.NDArray[np.int64] | None = None  # generation row of each row (None: same)
    quarantine_file: Path | None = None  # where failed reads go (None: DIR/quarantine.jsonl)
    lock: GenerationLock | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.slide_label_names and "tile_label" not in self.columns:
            self.slide_label_names = self.label_names  # labels are the slides' labels

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        root: str | None = None,
        exclude_quarantined: bool = False,
        split: str | None = None,
        generation: str | None = None,
        quarantine: str | os.PathLike[str] | None = None,
        where: Where | None = None,
    ) -> SlideIndex:
        """Open an index directory.

        ``root`` remaps where relative slide paths live (an index moved with its archive).
        ``exclude_quarantined`` leaves out tiles recorded in the quarantine. ``split`` keeps
        the slides of one split (the manifest's or labels file's ``split`` column).
        ``generation`` opens that generation instead of the current one (while it exists).
        ``quarantine`` is the file failed reads are appended to and excluded from, instead of
        DIR/quarantine.jsonl (an index on a read-only mount, or one per user).
        ``where`` keeps the rows it returns True for: a function of the columns (name ->
        array, ``index.columns``) returning one bool per row, e.g. ``lambda c: c["qc_pen"] <
        0.05`` or `wsi_loader.index.qc_filter` ("pen", "blur").
        """
        base = Path(path)
        if generation is None:
            gen = _current_generation(base)
        elif not generation.startswith("gen-") or "/" in generation:
            raise IndexFormatError(f"not a generation name: {generation!r}", path=str(base))
        else:
            gen = base / generation
        index = cls._open_generation(base, gen, None if root is None else expand_home(root))
        return index.view(
            exclude_quarantined=exclude_quarantined, split=split, quarantine=quarantine, where=where
        )

    @classmethod
    def _open_generation(
        cls, base: Path, gen: Path, root: str | None, check: bool = True
    ) -> SlideIndex:
        if not gen.is_dir():
            raise IndexFormatError(
                f"generation {gen.name} no longer exists: the index was rebuilt and the old "
                "generation removed; open the index again (SlideIndex.open) and recreate the "
                "dataset",
                path=str(base),
            )
        lock = GenerationLock(gen)
        try:
            meta = json.loads((gen / "meta.json").read_text(encoding="utf-8"))
            slides_json = json.loads((gen / "slides.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise IndexFormatError(f"unreadable index metadata: {exc}", path=str(gen)) from exc
        if not isinstance(meta, dict) or not isinstance(meta.get("tiles_total"), int):
            raise IndexFormatError(
                "meta.json is not an index's metadata (an object with tiles_total)",
                path=str(gen / "meta.json"),
            )
        if not isinstance(slides_json, list) or not all(
            isinstance(s, dict) and isinstance(s.get("path"), str) for s in slides_json
        ):
            raise IndexFormatError(
                "slides.json is not a list of slide records (objects with a path)",
                path=str(gen / "slides.json"),
            )
        version = meta.get("schema_version")
        if version != SCHEMA_VERSION:
            raise IndexFormatError(
                f"schema_version {version!r} is not supported (this wsi_loader reads "
                f"{SCHEMA_VERSION}); rebuild the index",
                path=str(base),
            )
        rows = meta["tiles_total"]
        classes = tuple(str(c) for c in meta.get("annotation_classes") or ())
        columns: TileArrays = {
            name: _load_column(gen, name, dtype, (rows,)) for name, dtype in TILE_COLUMNS.items()
        }
        for name, dtype in OPTIONAL_COLUMNS.items():  # annotated indexes only
            if name in (meta.get("columns") or {}):
                shape = (rows, len(classes)) if name == "coverage" else (rows,)
                columns[name] = _load_column(gen, name, dtype, shape)
        try:
            slides = tuple(SlideRecord.from_json(s) for s in slides_json)
        except TypeError as exc:
            raise IndexFormatError(f"malformed slide record: {exc}", path=str(gen)) from exc
        if check:  # the process that opened it checked; workers reopening it skip the pass
            check_params(meta, gen)
            check_values(columns, len(slides), gen)
            check_slides(columns, slides, gen)
        return cls(
            path=base,
            meta=meta,
            slides=slides,
            columns=columns,
            root=root if root is not None else meta.get("root"),
            label_names=tuple(meta.get("label_names", ())),
            # indexes written before tile labels existed name only slide labels
            slide_label_names=tuple(meta.get("slide_label_names", meta.get("label_names")) or ()),
            classes=classes,
            lock=lock,
        )

    # -- views -----------------------------------------------------------------------------
    @property
    def is_view(self) -> bool:
        """True when rows were left out (the columns are in-memory copies then)."""
        return self.source_rows is not None

    def splits(self) -> list[str]:
        """The split names of the indexed slides, sorted."""
        return sorted({s.split for s in self.slides if s.split is not None})

    def _keep_rows(self, keep: npt.NDArray[np.bool_], **changes: Any) -> SlideIndex:
        """A view of the rows where ``keep`` is True (``changes`` update the bookkeeping)."""
        if bool(keep.all()):
            return replace(self, **changes)
        rows = np.flatnonzero(keep).astype(np.int64)
        source = rows if self.source_rows is None else self.source_rows[rows]
        columns = {name: np.ascontiguousarray(col[rows]) for name, col in self.columns.items()}
        return replace(self, columns=columns, source_rows=source, **changes)

    def select(self, keep: npt.NDArray[np.bool_]) -> SlideIndex:
        """A view of the rows where ``keep`` (one bool per row) is True."""
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != (len(self),):
            raise ValueError(f"keep must be {len(self)} booleans, got shape {keep.shape}")
        return self._keep_rows(keep)

    def view(
        self,
        *,
        root: str | None = None,
        exclude_quarantined: bool = False,
        split: str | None = None,
        drop_slides: Iterable[int] = (),
        quarantine: str | os.PathLike[str] | None = None,
        where: Where | None = None,
    ) -> SlideIndex:
        """This index narrowed further: a remapped ``root``, quarantined tiles left out, only
        the slides of ``split``, without the slides ``drop_slides``, or only the rows
        ``where`` keeps (see `open`); or with its quarantine in another file (``quarantine``,
        see `open`). Views compose."""
        index = self if root is None else replace(self, root=expand_home(root))
        if quarantine is not None:
            index = replace(index, quarantine_file=quarantine_file(quarantine))
        if split is not None:
            if not isinstance(split, str):
                raise ValueError(f"split must be a string or None, got {split!r}")
            if index.split is not None and index.split != split:
                raise ValueError(
                    f"this index is already the {index.split!r} split; it has no {split!r} rows"
                )
            names = index.splits()
            if split not in names:
                raise IndexFormatError(
                    f"no slide is in split {split!r}; the splits are {names or 'none'} (set "
                    "them with a 'split' column in the manifest or the labels CSV)",
                    path=str(index.path),
                )
            in_split = np.array([s.split == split for s in index.slides] + [False])
            index = index._keep_rows(in_split[index.columns["slide_id"]], split=split)
        drop = sorted(set(drop_slides) - set(index.dropped_slides))
        if drop:
            flags = np.zeros(len(index.slides), dtype=bool)
            flags[drop] = True
            index = index._keep_rows(
                ~flags[index.columns["slide_id"]],
                dropped_slides=tuple(sorted({*index.dropped_slides, *drop})),
            )
        if exclude_quarantined:
            bad = index.quarantined_mask()
            index = index._keep_rows(~bad, excluded=index.excluded + int(bad.sum()))
        if where is not None:
            keep = _where_rows(where, index)
            index = index._keep_rows(keep, filtered=index.filtered + int((~keep).sum()))
        return index

    def __repr__(self) -> str:
        what = [
            f"{len(self)} tiles",
            f"{len(self.slides)} slides",
            str(self.meta.get("generation")),
        ]
        if self.split is not None:
            what.append(f"split={self.split!r}")
        if self.excluded:
            what.append(f"{self.excluded} quarantined tiles excluded")
        if self.filtered:
            what.append(f"{self.filtered} tiles left out by where")
        if self.dropped_slides:
            what.append(f"{len(self.dropped_slides)} slides dropped")
        return f"SlideIndex({str(self.path)!r}: {', '.join(what)})"

    def slide_starts(self) -> npt.NDArray[np.int64]:
        """First row of every slide plus the end (tiles of a slide are contiguous), so slide
        ``s`` owns rows ``starts[s]:starts[s + 1]``; valid after quarantine exclusion too."""
        starts = np.searchsorted(self.columns["slide_id"], np.arange(len(self.slides) + 1))
        return starts.astype(np.int64)

    def quarantined_mask(self) -> npt.NDArray[np.bool_]:
        """Boolean per row: is this tile in the quarantine (a tile record matched by slide path,
        x, y and level (any level for a record without one), and recorded for this version of
        the slide: records of a slide whose fingerprint has changed since, and slide-level
        records, leave its tiles in)."""
        by_path = self.quarantine.coords_by_path(
            {s.path: s.fingerprint for s in self.slides if s.fingerprint}
        )
        mask = np.zeros(len(self), dtype=bool)
        if not by_path:
            return mask
        starts = self.slide_starts()
        for sid, record in enumerate(self.slides):
            coords = by_path.get(record.path)
            if coords:
                rows = slice(int(starts[sid]), int(starts[sid + 1]))
                x, y = self.columns["l0_x"][rows], self.columns["l0_y"][rows]
                mask[rows] = coords_in(x, y, self.columns["level"][rows], coords)
        return mask

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without tile data: the receiver memory-maps the same generation again.

        A view's columns are in memory and travel as they are, so a worker never sees a
        different tile set than its parent. The receiver holds the generation's readers lock.
        """
        state = dict(self.__dict__)
        state["lock"] = None
        if not self.is_view:
            state["columns"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        gen = self.path / str(self.meta["generation"])
        if self.columns is None:
            fresh = SlideIndex._open_generation(self.path, gen, self.root, check=False)
            self.columns, self.lock = fresh.columns, fresh.lock
        else:
            self.lock = GenerationLock(gen) if gen.is_dir() else None

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
        """Failed reads: DIR/quarantine.jsonl, or the file the index was opened with."""
        return Quarantine(self.quarantine_file or self.path / "quarantine.jsonl")

    def slide_path(self, slide_id: int) -> str:
        """Absolute path of a slide, with the root (or its remapping) applied."""
        stored = self.slides[slide_id].path
        if os.path.isabs(stored) or is_url(stored) or self.root is None:
            return stored
        if is_url(self.root):
            return url_join(self.root + "/", stored)
        return os.path.join(self.root, stored)

    def slide_labels(self) -> npt.NDArray[np.int64]:
        """Label id per slide (position in ``slide_label_names``), -1 when unlabelled."""
        lookup = {name: i for i, name in enumerate(self.slide_label_names)}
        return np.array(
            [lookup.get(s.label, -1) if s.label is not None else -1 for s in self.slides],
            dtype=np.int64,
        )

    def label_counts(self, split: str | None = None) -> dict[str, dict[str, int]]:
        """Slides and tiles per label name, in id order, of ``split`` when given. Slide labels:
        the ok slides with that label and their tiles; tile labels (annotations): the tiles of
        each class and the slides that have any. Labels with neither are left out. A view of
        a split counts that split."""
        split = self.split if split is None else split
        names = self.label_names
        if not names:
            return {}
        labels = self.tile_labels()
        slide_ids = np.asarray(self.columns["slide_id"], dtype=np.int64)
        in_split = np.array([split is None or s.split == split for s in self.slides], dtype=bool)
        keep = in_split[slide_ids] & (labels >= 0)
        labels, slide_ids = labels[keep], slide_ids[keep]
        tiles = np.bincount(labels, minlength=len(names))
        if self.labels_from_annotations:
            pairs = np.unique(slide_ids * len(names) + labels)
            slides = np.bincount(pairs % len(names), minlength=len(names))
        else:
            per_slide = self.slide_labels()
            ok = np.array([s.status == "ok" for s in self.slides], dtype=bool)
            slides = np.bincount(per_slide[ok & in_split & (per_slide >= 0)], minlength=len(names))
        return {
            name: {"slides": int(slides[i]), "tiles": int(tiles[i])}
            for i, name in enumerate(names)
            if slides[i] or tiles[i]
        }

    @property
    def labels_from_annotations(self) -> bool:
        return "tile_label" in self.columns

    def tile_labels(self, rows: npt.ArrayLike | None = None) -> npt.NDArray[np.int64]:
        """Label id (position in ``label_names``) of each row (or of ``rows``), -1 when none:
        the annotated class with ``label_from="annotations"``, else the slide's label."""
        picked = slice(None) if rows is None else np.asarray(rows, dtype=np.int64)
        if self.labels_from_annotations:
            return np.asarray(self.columns["tile_label"][picked], dtype=np.int64)
        labels: npt.NDArray[np.int64] = self.slide_labels()[
            np.asarray(self.columns["slide_id"][picked])
        ]
        return labels

    @property
    def coverage(self) -> npt.NDArray[np.float32] | None:
        """``(tiles, len(classes))`` share of each tile covered by each annotation class, or
        None for an index built without annotations."""
        return self.columns.get("coverage")

    def summary(self) -> dict[str, Any]:
        """The JSON object `wsi-loader info --json` prints (for this view: ``tiles`` counts
        its rows, ``split`` names its split)."""
        records = self.quarantine.read()
        starts = self.slide_starts()
        split_counts: dict[str, dict[str, Any]] = {}
        for sid, s in enumerate(self.slides):
            if s.split is not None:
                entry = split_counts.setdefault(s.split, {"slides": 0, "tiles": 0})
                entry["slides"] += 1
                entry["tiles"] += int(starts[sid + 1] - starts[sid])
        for name, entry in split_counts.items():
            entry["labels"] = self.label_counts(name)
        limits = built_thresholds(self.params)
        per_slide_qc = qc_counts(self.columns, starts, limits)
        return {
            "path": str(self.path),
            "schema_version": self.schema_version,
            "generation": self.meta.get("generation"),
            "created": self.meta.get("created"),
            "params": self.params,
            "root": self.root,
            "split": self.split,
            "tiles": len(self),
            "label_names": list(self.label_names),
            "label_from": "annotations" if self.labels_from_annotations else "slides",
            "slide_label_names": list(self.slide_label_names),
            "annotation_classes": list(self.classes),
            "annotations_report": self.meta.get("annotations_report"),
            "labels_report": self.meta.get("labels_report"),
            "label_counts": self.label_counts(),
            "splits": split_counts,
            "copies": self.meta.get("copies", []),
            "build": self.meta.get("build"),
            "stain": stain_summary((s.path, s.stain) for s in self.slides if s.status == "ok"),
            "slides": [
                {
                    "slide_id": i,
                    "path": s.path,
                    "status": s.status,
                    "error": s.error,
                    "warning": s.warning,
                    "tiles": int(starts[i + 1] - starts[i]),
                    "mpp": s.mpp,
                    "mpp_source": s.mpp_source,
                    "tile_mpp": s.tile_mpp,
                    "objective_power": s.objective_power,
                    "tile_mag": s.tile_mag,
                    "mag_source": s.mag_source,
                    "read_level": s.read_level,
                    "read_size": s.read_size,
                    "label": s.label,
                    "split": s.split,
                    "backend": s.backend,
                    "vendor": s.vendor,
                    "width": s.width,
                    "height": s.height,
                    "stain": s.stain,
                    "stain_error": s.stain_error,
                    "tissue_detector": s.tissue_detector,
                    "tissue_reason": s.tissue_reason,
                    "qc": None
                    if per_slide_qc is None
                    else per_slide_qc[i] | {"excluded": excluded_counts(s.qc)},
                    "qc_summary": slide_summary(s.qc),
                }
                for i, s in enumerate(self.slides)
                if self.split is None or s.split == self.split
            ],
            "qc": None
            if per_slide_qc is None
            else qc_totals(per_slide_qc, limits, self.slides, self.split),
            "filtered": self.filtered,
            "quarantine_path": str(self.quarantine.path),
            "quarantine": {
                "tiles": sum(r.get("kind", "tile") == "tile" for r in records),
                "slides": sum(r.get("kind") == "slide" for r in records),
            },
            "quarantined": records,
        }


def _where_rows(where: Where, index: SlideIndex) -> npt.NDArray[np.bool_]:
    """What ``where`` keeps of ``index``'s rows, checked: one bool per row."""
    if not callable(where):
        raise TypeError(
            f"where must be a function of the columns returning one bool per row, got "
            f"{type(where).__name__}"
        )
    # a qc_filter reads the index's own thresholds; any other function gets the columns
    keep = np.asarray(where(index) if isinstance(where, QcFilter) else where(index.columns))
    if keep.dtype != np.bool_ or keep.shape != (len(index),):
        raise ValueError(
            f"where must return {len(index)} booleans (one per row), got {keep.dtype} of shape "
            f"{keep.shape}; compare columns, e.g. lambda c: c['qc_pen'] < 0.05"
        )
    return keep


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


def _load_column(
    gen: Path, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> npt.NDArray[Any]:
    """One column file, memory-mapped, checked against the dtype and shape meta.json gives."""
    file = gen / f"{name}.npy"
    try:
        array = np.load(file, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:  # EOFError: a zero-byte file
        raise IndexFormatError(f"unreadable column {name!r}: {exc}", path=str(file)) from exc
    if array.dtype != dtype or array.shape != shape:
        raise IndexFormatError(
            f"column {name!r} has dtype {array.dtype}, shape {array.shape}; expected "
            f"{dtype} with {shape[0]} rows"
            + (f" and {shape[1]} class columns" if len(shape) > 1 else ""),
            path=str(file),
        )
    return mapped(array)


def _current_generation(base: Path) -> Path:
    pointer = base / CURRENT
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise IndexFormatError("not an index directory (no CURRENT file)", path=str(base)) from None
    except OSError as exc:
        raise IndexFormatError(f"cannot read {CURRENT}: {exc.strerror}", path=str(base)) from exc
    except UnicodeDecodeError:
        raise IndexFormatError(
            f"{CURRENT} is not a generation name (binary data)", path=str(base)
        ) from None
    gen = base / name
    if not name.startswith("gen-") or "/" in name or not gen.is_dir():
        raise IndexFormatError(f"CURRENT names a missing generation {name!r}", path=str(base))
    return gen


BUILD_LOCK = "build.lock"
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def similar_labels(labels: Iterable[str]) -> list[list[str]]:
    """Groups of distinct labels that differ only in case, spacing, '_' or '-' ('Tumor' /
    'tumor', 'high grade' / 'high_grade'): two classes, where one was almost surely meant."""
    groups: dict[str, set[str]] = {}
    for name in labels:
        groups.setdefault(re.sub(r"[\s_-]+", " ", name.casefold()).strip(), set()).add(name)
    return sorted(sorted(group) for group in groups.values() if len(group) > 1)


def warn_similar(names: Iterable[str], what: str) -> None:
    """Say which labels differ only in case or spacing: kept apart, they are separate classes."""
    groups = similar_labels(names)
    if groups:
        shown = "; ".join(" / ".join(repr(n) for n in group) for group in groups[:5])
        log.warning(
            "%s that differ only in case or spacing: %s. They are separate classes; spell "
            "each one way if one class is meant",
            what,
            shown,
        )


# how pandas (astype(str)), R, Excel and SQL exports write a missing value
MISSING_SPELLINGS = frozenset({"nan", "na", "n/a", "#n/a", "<na>", "none", "null", "nat"})


def warn_missing_spelt(labels: list[str]) -> None:
    """Say which labels spell a missing value ('nan', 'NA'...): each is a class of its own,
    which a model then learns as if it were a diagnosis. Kept: the user decides."""
    counts = Counter(label for label in labels if label.strip().casefold() in MISSING_SPELLINGS)
    if counts:
        shown = ", ".join(
            f"{label!r} ({n} slide{'s' * (n != 1)})" for label, n in sorted(counts.items())
        )
        log.warning(
            "labels that look like a missing value written by pandas, R or a spreadsheet: %s. "
            "They are classes of their own; leave slides without a label out of the labels "
            "file",
            shown,
        )


def warn_split_gaps(index: SlideIndex) -> None:
    """Say which split lacks a label another split has: its metrics cannot measure that
    class (a validation split without a single tumour slide)."""
    splits = index.splits()
    if len(splits) < 2:
        return
    counts = {split: index.label_counts(split) for split in splits}
    unit = "tile" if index.labels_from_annotations else "slide"
    gaps = []
    for split in splits:
        for name in index.label_names:
            others = [
                f"{other} has {counts[other][name][unit + 's']}"
                for other in splits
                if other != split and name in counts[other]
            ]
            if name not in counts[split] and others:
                gaps.append(
                    f"split {split!r} has no {unit} labelled {name!r} ({', '.join(others)})"
                )
    if gaps:
        more = f"; and {len(gaps) - 10} more" if len(gaps) > 10 else ""
        log.warning(
            "%s%s: metrics on such a split cannot measure that class",
            "; ".join(gaps[:10]),
            more,
        )


def label_order(labels: Iterable[str]) -> list[str]:
    """Label names in id order: by value when every label is a number (grades, class numbers:
    '2' before '10'), else as text. Ties ('1', '01') are broken by the text."""
    names = set(labels)
    if names and all(_NUMBER.fullmatch(name) for name in names):
        return sorted(names, key=lambda name: (float(name), name))
    return sorted(names)


@contextmanager
def exclusive_build(out: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``DIR/build.lock`` for one build: a second build into the same folder fails at
    once with "another build is running" instead of racing the first (its temporary
    generation removed under it)."""
    base = Path(out)
    if base.exists() and not base.is_dir():
        raise IndexFormatError("the index output exists and is not a folder", path=str(base))
    created = not base.exists()
    try:
        base.mkdir(parents=True, exist_ok=True)
        fd = os.open(base / BUILD_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise IndexFormatError(
            f"cannot write the index folder: {exc.strerror}", path=str(base)
        ) from exc
    try:
        try:
            lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, base / BUILD_LOCK)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            raise IndexFormatError(
                f"another build is running into this index (pid {holder}); wait for it to finish",
                path=str(base),
            ) from None
        try:  # who holds the lock, for the message above; a full disk fails the build later
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            log.debug("cannot record the build's pid in %s: %s", base / BUILD_LOCK, exc)
        try:
            yield
        except BaseException:
            if created and not (base / CURRENT).exists():  # a failed first build leaves nothing
                shutil.rmtree(base, ignore_errors=True)
            raise
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _no_partial_generation(out: str | os.PathLike[str]) -> Iterator[None]:
    """A write that fails (a full disk, an interrupt) removes its partial generation, which
    holds disk space; a system error becomes `IndexFormatError` with the reason."""
    try:
        yield
    except BaseException as exc:
        for partial in Path(out).glob(f".gen-*.tmp-{os.getpid()}"):
            shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(exc, OSError):
            raise
        raise IndexFormatError(
            f"cannot write the index: {exc.strerror or exc}; the previous index (if any) is "
            "unchanged: make room and run the same command again",
            path=os.fspath(out),
        ) from exc


def write_index(
    out: str | os.PathLike[str],
    slides: Sequence[SlideRecord],
    tiles: Sequence[TileArrays],
    params: Mapping[str, Any],
    root: str | None,
    extra_meta: Mapping[str, Any] | None = None,
) -> SlideIndex:
    """Write a new generation atomically. ``tiles[i]`` holds slide i's columns (any length).

    A write that fails (a full disk) leaves the previous generation current and no partial
    one behind, and raises `IndexFormatError` with the reason."""
    with _no_partial_generation(out):
        base = Path(out)
        name = _write_generation(base, slides, tiles, params, root, extra_meta)
        _remove_stale(base, keep=name)
        return SlideIndex.open(base)


def _write_generation(
    base: Path,
    slides: Sequence[SlideRecord],
    tiles: Sequence[TileArrays],
    params: Mapping[str, Any],
    root: str | None,
    extra_meta: Mapping[str, Any] | None,
) -> str:
    """`write_index`'s work: the new generation, made current; returns its name."""
    base.mkdir(parents=True, exist_ok=True)
    previous = None
    if (base / CURRENT).exists():
        previous = _current_generation(base).name
    number = int(previous.split("-")[1]) + 1 if previous else 1
    name = f"gen-{number:06d}"
    tmp = base / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / READERS_LOCK).touch()

    records, first = [], 0
    for record, arrays in zip(slides, tiles, strict=True):
        count = len(arrays["l0_x"]) if arrays else 0
        records.append(asdict(record) | {"tiles": count, "first_row": first})
        first += count
    labels = label_order(
        r["label"] for r in records if r["label"] is not None and r["status"] == "ok"
    )
    # optional columns are written when every slide has them (the builder sees to that)
    optional = {
        name: dtype
        for name, dtype in OPTIONAL_COLUMNS.items()
        if tiles and all(name in t for t in tiles)
    }
    written = {**TILE_COLUMNS, **optional}
    for col, dtype in written.items():
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
        "slide_label_names": labels,
        "columns": {k: str(v) for k, v in written.items()},
        **(extra_meta or {}),
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
    return name


def _remove_stale(base: Path, keep: str) -> None:
    """Delete older generations no process uses any more, and leftovers of killed builds."""
    for entry in base.iterdir():
        if entry.name == keep or not entry.is_dir():
            continue
        if entry.name.startswith("gen-"):
            if _unused(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                log.info("keeping %s: a process still reads it", entry)
        elif entry.name.startswith(".gen-"):
            shutil.rmtree(entry, ignore_errors=True)


def split_tiles(index: SlideIndex, slide_id: int) -> TileArrays:
    """Copy one slide's rows out of an index (used to carry unchanged slides over)."""
    record = index.slides[slide_id]
    rows = slice(record.first_row, record.first_row + record.tiles)
    return {name: np.array(col[rows]) for name, col in index.columns.items()}


def records_by_path(index: SlideIndex) -> dict[str, tuple[int, SlideRecord]]:
    return {r.path: (i, r) for i, r in enumerate(index.slides)}
