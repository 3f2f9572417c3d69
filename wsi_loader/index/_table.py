"""The on-disk slide index: a slide table plus memory-mapped numpy tile columns, opened as a
`SlideIndex` (a generation's files: `_table_files`; writing them: `_table_writer`).

A `SlideIndex` may be a *view*: rows of one split, without quarantined tiles or without some
slides (`SlideIndex.view`). Slide ids stay those of the generation; ``source_rows`` maps each
row of the view back to its row in the generation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import ConfigError, IndexFormatError
from wsi_loader.files import expand_home
from wsi_loader.index._checks import check_params, check_slides, check_values
from wsi_loader.index._labels import patient_of, split_choices, split_mask, split_members
from wsi_loader.index._qc import (
    QcFilter,
    built_thresholds,
    excluded_counts,
    qc_totals,
    slide_summary,
)
from wsi_loader.index._qc import counts as qc_counts
from wsi_loader.index._quarantine import Quarantine, coords_in, quarantine_file
from wsi_loader.index._stain_estimates import summary as stain_summary
from wsi_loader.index._table_files import (
    OPTIONAL_COLUMNS,
    SCHEMA_VERSION,
    TILE_COLUMNS,
    GenerationLock,
    SlideRecord,
    TileArrays,
    current_generation,
    load_column,
)
from wsi_loader.slides.storage._sources import is_url, url_join

# a row filter: the columns (name -> array) in, one bool per row out
Where = Callable[[Mapping[str, npt.NDArray[Any]]], npt.ArrayLike]


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
            gen = current_generation(base)
        elif not generation.startswith("gen-") or "/" in generation:
            raise IndexFormatError(f"not a generation name: {generation!r}", path=str(base))
        else:
            gen = base / generation
        index = cls._open_generation(base, gen, None if root is None else expand_home(root))
        if root is not None:
            index._check_remappable(root)
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
            name: load_column(gen, name, dtype, (rows,)) for name, dtype in TILE_COLUMNS.items()
        }
        for name, dtype in OPTIONAL_COLUMNS.items():  # annotated indexes only
            if name in (meta.get("columns") or {}):
                shape = (rows, len(classes)) if name == "coverage" else (rows,)
                columns[name] = load_column(gen, name, dtype, shape)
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
        if root is not None:
            self._check_remappable(root)
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
            members = split_members(index.slides, split)
            if members is None:
                raise IndexFormatError(
                    f"no slide is in split {split!r}; the splits are "
                    f"{split_choices(index.splits())} (set them with a 'split' column in the "
                    "manifest or the labels CSV, or with wsi-loader split)",
                    path=str(index.path),
                )
            in_split = np.array([*members, False])
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

    def _check_remappable(self, root: str) -> None:
        """A root remaps relative slide paths only: for an index whose every slide path is
        absolute (built without a root) it would change nothing, so it is refused, not
        silently ignored."""
        if self.meta.get("root") is not None:  # built with a root: remapped, or reopened
            return
        if self.slides and all(os.path.isabs(s.path) or is_url(s.path) for s in self.slides):
            raise ConfigError(
                f"root {root!r} (--root) cannot remap this index: it stores absolute slide "
                "paths (it was built without a root), which are read where they are; drop "
                "the root, or rebuild the index with one (wsi-loader index ... --root DIR, "
                "build_index(..., root=DIR)) to make it movable",
                path=str(self.path),
                key="root",
                value=root,
            )

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
        in_split = np.array(split_mask(self.slides, split), dtype=bool)
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
        chosen = split_mask(self.slides, self.split)  # the slides of this view's split
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
                    "patient": patient_of(s),  # given, or a TCGA name's case: what splits keep
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
                if chosen[i]
            ],
            "qc": None
            if per_slide_qc is None
            else qc_totals(
                [q for q, c in zip(per_slide_qc, chosen, strict=True) if c],
                limits,
                [s for s, c in zip(self.slides, chosen, strict=True) if c],
            ),
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
