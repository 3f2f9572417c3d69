"""Build an index: discover slides, find tissue on a low level, lay the grid, write atomically.

`build_index` matches the inputs (labels, annotation files, tissue masks), carries over the
slides of the previous index that have not changed (`_incremental`), indexes the others in
parallel units (`_slide_task.index_slide`, one per slide), checks and reports the results
(`_build_checks`) and writes them as the index's new generation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from wsi_loader.config import IndexConfig, with_overrides
from wsi_loader.errors import InputError, SlideError
from wsi_loader.index import _incremental as incremental
from wsi_loader.index import _qc as qc
from wsi_loader.index._build_checks import (
    check_class_names,
    check_labels,
    check_shrink,
    check_splits,
    copies,
    say_failures,
    warn_annotations,
    warn_dark_field,
    warn_masks,
)
from wsi_loader.index._fingerprints import TIFF_KIND, unchanged
from wsi_loader.index._inputs import discover, join_labels
from wsi_loader.index._labels import (
    check_patient_splits,
    warn_missing_spelt,
    warn_similar,
    warn_split_gaps,
)
from wsi_loader.index._quarantine import Quarantine, coords_in
from wsi_loader.index._slide_task import SlideTask, empty_tiles, given_up, index_slide
from wsi_loader.index._stain_estimates import is_current as stain_is_current
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import SlideRecord, TileArrays
from wsi_loader.index._table_writer import (
    exclusive_build,
    records_by_path,
    split_tiles,
    write_index,
)
from wsi_loader.index._tissue_masks import match_masks
from wsi_loader.index.annotations import _formats as formats
from wsi_loader.index.annotations import match_annotations
from wsi_loader.index.annotations._shapes import shorten
from wsi_loader.index.annotations._tiles import label_names, label_tiles, to_columns
from wsi_loader.parallel import progress_bar, refuse_time_limit_with_executor, run_all
from wsi_loader.slides._base import join_notes
from wsi_loader.slides.storage._sources import is_url, remote_stat

log = logging.getLogger(__name__)


def _stored_path(path: str, root: str | None) -> str:
    if root is None:
        return path
    if is_url(path) or is_url(root):
        prefix = root.rstrip("/") + "/"
        return path[len(prefix) :] if path.startswith(prefix) else path
    rel = os.path.relpath(path, root)
    return path if rel.startswith(os.pardir + os.sep) or rel == os.pardir else rel


def _exists(path: str) -> bool:
    """Whether a slide file or object exists (an unreachable store: no)."""
    if not is_url(path):
        return os.path.exists(path)
    try:
        remote_stat(path)
    except SlideError:
        return False
    return True


def _remote_reason(url: str) -> str:
    try:
        remote_stat(url, retries=0)
    except SlideError as exc:
        return f"{exc}; nothing was written"
    return f"{url} answers now; run again"


def _with_qc_columns(arrays: TileArrays) -> TileArrays:
    """``arrays`` with every QC column (NaN where a slide has none: a failed slide)."""
    rows = len(arrays["l0_x"])
    missing = {
        name: np.full(rows, np.nan, dtype=dtype)
        for name, dtype in qc.QC_COLUMNS.items()
        if name not in arrays
    }
    return {**arrays, **missing} if missing else arrays


def _keep_split(record: SlideRecord, kept: dict[str, str]) -> SlideRecord:
    """``record`` with the split `wsi-loader split` gave it (by its path, else by its
    content: a slide moved), unless its input gives one."""
    if record.split is not None:
        return record
    split = kept.get(record.path) or kept.get(f"content:{record.content}")
    return record if split is None else replace(record, split=split)


def _label_tiles(
    results: list[tuple[SlideRecord, TileArrays]], cfg: IndexConfig
) -> tuple[list[tuple[SlideRecord, TileArrays]], dict[str, Any]]:
    """Every slide's coverage in the columns of all classes, tile labels when they come from
    the annotations, and the metadata that names them."""
    classes = sorted({c for record, _ in results for c in (record.class_areas or {})})
    if len(classes) > formats.MAX_CLASSES:  # each slide's are within it; all of them are not
        raise InputError(
            f"{len(classes):,} annotation classes in all, more than the {formats.MAX_CLASSES:,} "
            f"an index holds (each class is a coverage column of every tile), e.g. "
            f"{', '.join(shorten(c) for c in classes[:5])}; nothing was written"
        )
    warn_similar(classes, "annotation classes")
    names = label_names(classes, cfg) if cfg.label_from == "annotations" else []
    per_class = {c: {"slides": 0, "tiles_labelled": 0} for c in classes}
    out = []
    for record, found in results:
        arrays = dict(found) if found else empty_tiles()
        own = list(record.class_areas or {})
        coverage = arrays.get("coverage", np.zeros((len(arrays["l0_x"]), len(own))))
        arrays["coverage"] = to_columns(np.asarray(coverage, np.float32), own, classes)
        for c in own:
            per_class[c]["slides"] += 1
        if cfg.label_from == "annotations":
            labels = label_tiles(arrays["coverage"], classes, record.class_areas or {}, names, cfg)
            arrays["tile_label"] = labels
            for c, count in zip(*np.unique(labels[labels >= 0], return_counts=True), strict=True):
                if names[c] in per_class:
                    per_class[names[c]]["tiles_labelled"] += int(count)
        out.append((record, arrays))
    meta: dict[str, Any] = {
        "annotation_classes": classes,
        "annotations_report": {"classes": per_class},
    }
    if cfg.label_from == "annotations":
        meta["label_names"] = names
    return out, meta


def _run(
    tasks: list[SlideTask], cfg: IndexConfig, executor: Any, progress: bool
) -> list[tuple[SlideRecord, TileArrays]]:
    with progress_bar(len(tasks), "slide", "indexing", progress and bool(tasks)) as bar:
        return run_all(
            index_slide,
            tasks,
            cfg.workers,
            executor,
            bar,
            timeout=cfg.slide_timeout or None,
            given_up=given_up,
        )


def build_index(
    inputs: Iterable[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    config: IndexConfig | None = None,
    *,
    executor: Any = None,
    progress: bool = False,
    **overrides: Any,
) -> SlideIndex:
    """Index slides (files, folders, globs, CSV manifests) into the directory ``out``.

    ``overrides`` are `IndexConfig` fields (``tile_size=224, mpp=0.5, workers=4``...). Slides
    already in ``out`` with an unchanged fingerprint and the same grid parameters are carried
    over without being opened; failed slides are retried. ``executor``: None (local processes
    when ``workers > 1``), any concurrent.futures Executor, or a ``dask.distributed.Client``
    (workers return small per-slide results; the client writes the index). Returns the new
    `SlideIndex`.
    """
    cfg = with_overrides(config or IndexConfig(), **overrides)
    refuse_time_limit_with_executor("slide_timeout", cfg.slide_timeout, executor)
    out = os.fspath(out)
    with exclusive_build(out):
        return _build(inputs, out, cfg, executor, progress)


def _build(
    inputs: Iterable[str | os.PathLike[str]],
    out: str,
    cfg: IndexConfig,
    executor: Any,
    progress: bool,
) -> SlideIndex:
    root = (cfg.root if is_url(cfg.root) else os.path.abspath(cfg.root)) if cfg.root else None
    names = [os.fspath(i) for i in inputs]
    entries = discover(names)
    if not entries:
        raise InputError(
            f"no slide files found in {', '.join(names) or 'no inputs'}; nothing was written"
        )
    if not any(_exists(e.path) for e in entries):
        if all(is_url(e.path) for e in entries):  # say the store's reason (unreachable...)
            raise InputError(f"none of the inputs can be read: {_remote_reason(entries[0].path)}")
        manifests = [n for n in names if n.lower().endswith(".csv") and os.path.isfile(n)]
        if manifests:  # they exist: the slides they list do not
            shown = ", ".join(e.path for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise InputError(
                f"none of the slides exists ({shown}, listed in {', '.join(manifests[:3])}; "
                "paths are relative to the manifest); is the share mounted? Nothing was written"
            )
        raise InputError(
            f"none of the inputs exists ({', '.join(names[:3])}); is the share mounted? "
            "Nothing was written"
        )
    label_report = None
    if cfg.labels:
        entries, label_report = join_labels(entries, cfg.labels)
        check_labels(label_report, cfg.labels, cfg.strict_labels)
    warn_similar({e.label for e in entries if e.label is not None}, "labels")
    warn_missing_spelt([e.label for e in entries if e.label is not None])
    files_of: dict[str, tuple[str, ...]] = {}
    annotation_report = None
    if cfg.annotations is not None:
        files_of, annotation_report = match_annotations(entries, cfg.annotations)
        warn_annotations(annotation_report, cfg.annotations)
    elif any(e.annotations for e in entries):
        log.warning(
            "the manifest's 'annotations' column is only read with annotations set: pass the "
            "manifest as --annotations (annotations=...) to use it"
        )
    masks: dict[str, str] = {}
    if cfg.tissue_masks is not None:
        masks, mask_report = match_masks(entries, cfg.tissue_masks)
        warn_masks(mask_report, cfg.tissue_masks, cfg.tissue_detector)
    previous = incremental.previous(out, cfg)
    kept, split_plan = incremental.kept_splits(out, previous)
    old = records_by_path(previous) if previous else {}
    old_classes = list(previous.classes) if previous else []

    slots: list[tuple[SlideRecord, TileArrays] | SlideTask] = []
    reused = upgraded = 0
    for entry in entries:
        stored = _stored_path(entry.path, root)
        files = files_of.get(entry.path, ())
        hit = old.get(stored)
        # a slide with quarantined tiles left out is indexed again, so tiles whose records
        # were cleared since come back (indexing one slide costs a low-resolution read)
        if (
            hit
            and hit[1].status == "ok"
            and not hit[1].excluded
            and previous is not None
            and incremental.same_annotations(hit[1], files, cfg)
            and stain_is_current(hit[1].stain, hit[1].stain_error)  # else: an older estimate
            and incremental.same_mask(hit[1], masks.get(entry.path))
        ):
            # the fingerprint and the content digest (a TIFF's directory: a tile rewritten
            # in the middle, mtime kept, is indexed again)
            content = unchanged(entry.path, hit[1].fingerprint, hit[1].content)
            if content is not None:
                upgraded += content.startswith(TIFF_KIND) != (hit[1].content or "").startswith(
                    TIFF_KIND
                )
                record = replace(
                    hit[1],
                    label=entry.label,
                    split=entry.split,
                    patient=entry.patient,
                    content=content,
                )
                arrays = split_tiles(previous, hit[0])
                arrays.pop("tile_label", None)  # labels are derived again below
                if cfg.annotations is None:
                    arrays.pop("coverage", None)
                    record = replace(
                        record, annotations=None, annotation_digest=None, class_areas=None
                    )
                else:
                    own = list(record.class_areas or {})
                    arrays["coverage"] = to_columns(arrays["coverage"], old_classes, own)
                slots.append((record, arrays))
                reused += 1
                continue
        slots.append(
            SlideTask(
                entry=entry,
                stored_path=stored,
                config=cfg,
                annotations=files,
                tissue_mask=masks.get(entry.path),
            )
        )
    tasks = [s for s in slots if isinstance(s, SlideTask)]
    log.info("%d slides: %d unchanged, %d to index", len(entries), reused, len(tasks))
    if upgraded:
        log.info(
            "%d unchanged slides had a content digest of an older kind (size, first and last "
            "64 KiB): recorded again with their TIFF directory (every tile's offset and size)",
            upgraded,
        )
    if cfg.annotations is not None:
        check_class_names(cfg, tasks, [s[0] for s in slots if not isinstance(s, SlideTask)])
    had_ok = previous is not None and any(r.status == "ok" for r in previous.slides)
    del previous  # releases its generation, which write_index may then delete
    done = iter(_run(tasks, cfg, executor, progress))
    results = [next(done) if isinstance(s, SlideTask) else s for s in slots]
    results.sort(key=lambda r: r[0].path)
    if cfg.qc != "none":  # failed slides too: a column is written when every slide has it
        results = [(record, _with_qc_columns(arrays)) for record, arrays in results]
    warn_dark_field([record for record, _ in results], cfg.tissue_detector)
    say_failures([record for record, _ in results], out)
    if had_ok and not any(record.status == "ok" for record, _ in results):
        raise InputError(
            f"no slide could be indexed, so the index in {out} was left as it is "
            "(see the warnings above for each slide's reason)"
        )
    check_shrink(out, [record for record, _ in results], cfg.allow_shrink)
    results = [(_keep_split(record, kept), arrays) for record, arrays in results]
    if kept:
        log.info(
            "kept the splits wsi-loader split gave: %d slides keep theirs",
            sum(
                r.split is not None and _keep_split(replace(r, split=None), kept) == r
                for r, _ in results
            ),
        )
    check_splits([record for record, _ in results], root)
    try:
        check_patient_splits([record for record, _ in results])
    except InputError as exc:
        if not kept:
            raise
        raise InputError(
            f"{exc}; the splits wsi-loader split wrote are kept for the slides the inputs give "
            "none: give the patient's other slides that split too, or drop the inputs' split "
            "and run wsi-loader split again"
        ) from None
    extra: dict[str, Any] = {
        "copies": copies([record for record, _ in results]),
        "build": {"unchanged": reused, "indexed": len(tasks)},  # what this build did
    }
    if split_plan is not None:
        extra["splits"] = split_plan
    if label_report is not None:
        extra["labels_report"] = label_report.as_json()
    if cfg.annotations is not None and annotation_report is not None:
        results, annotation_meta = _label_tiles(results, cfg)
        extra |= annotation_meta
        extra["annotations_report"] |= annotation_report.as_json()

    fingerprints = {r.path: r.fingerprint for r, _ in results if r.fingerprint}
    quarantined = (
        Quarantine(os.path.join(out, "quarantine.jsonl")).coords_by_path(fingerprints)
        if cfg.exclude_quarantined
        else {}
    )
    records, tiles = [], []
    for slide_id, (found, found_tiles) in enumerate(results):
        record, arrays = found, dict(found_tiles)
        drop = coords_in(
            arrays["l0_x"], arrays["l0_y"], arrays["level"], quarantined.get(record.path, set())
        )
        if drop.any():
            arrays = {k: v[~drop] for k, v in arrays.items()}
            note = f"{int(drop.sum())} quarantined tiles excluded"
            record = replace(
                record,
                tiles=len(arrays["l0_x"]),
                excluded=int(drop.sum()),
                warning=join_notes(record.warning, note),
            )
        arrays["slide_id"] = np.full(len(arrays["l0_x"]), slide_id, dtype=np.int32)
        records.append(record)
        tiles.append(arrays)
    params = cfg.model_dump()
    index = write_index(out, records, tiles, params, root, extra)
    warn_split_gaps(index)
    failed = sum(r.status == "failed" for r in records)
    log.info("indexed %d slides (%d failed), %d tiles -> %s", len(records), failed, len(index), out)
    return index
