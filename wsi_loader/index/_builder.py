"""Build an index: discover slides, find tissue on a low level, lay the grid, write atomically.

Each slide is indexed by `index_slide`, a plain function of small picklable arguments that
returns the slide's record and coordinate arrays, so it runs inline, in a process pool, or on
any ``concurrent.futures.Executor`` (a Dask cluster's ``client.get_executor()``). It never
raises: a slide that cannot be indexed comes back as a failed record with the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from wsi_loader.config import IndexConfig, with_overrides
from wsi_loader.errors import (
    AnnotationError,
    IndexFormatError,
    InputError,
    ResolutionError,
    SlideError,
)
from wsi_loader.index import _qc as qc
from wsi_loader.index._analyses import analyse_slide
from wsi_loader.index._fingerprints import content_key, fingerprint, identify
from wsi_loader.index._geometry import grid, mag_disagreement, plan_read
from wsi_loader.index._inputs import LabelReport, SlideEntry, discover, join_labels
from wsi_loader.index._labels import warn_missing_spelt, warn_similar, warn_split_gaps
from wsi_loader.index._lowres import FloatArray, TileBoxes
from wsi_loader.index._quarantine import Quarantine, coords_in
from wsi_loader.index._stain_estimates import is_current as stain_is_current
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import CURRENT, TILE_COLUMNS, SlideRecord, TileArrays
from wsi_loader.index._table_writer import (
    exclusive_build,
    records_by_path,
    split_tiles,
    write_index,
)
from wsi_loader.index._tissue_masks import MaskReport, match_masks
from wsi_loader.index.annotations import AnnotationReport, files_digest, match_annotations
from wsi_loader.index.annotations import _formats as formats
from wsi_loader.index.annotations._formats import read_annotations, shorten
from wsi_loader.index.annotations._regions import ReadShapes, read_shapes
from wsi_loader.index.annotations._tiles import (
    SlideAnnotations,
    annotate_slide,
    label_names,
    label_tiles,
    to_columns,
)
from wsi_loader.parallel import (
    GivenUp,
    progress_bar,
    refuse_time_limit_with_executor,
    run_all,
)
from wsi_loader.slides._base import join_notes
from wsi_loader.slides._open import open_slide
from wsi_loader.slides.storage._sources import is_url, remote_stat

log = logging.getLogger(__name__)

# Parameters that change the tiles of a slide: an index built with others is not reused.
GRID_PARAMS = (
    "tile_size",
    "mpp",
    "level",
    "mag",
    "context",  # slides that cannot serve the context scales fail
    "mpp_tolerance",
    "stride",
    "min_tissue",
    "align_to_storage",
    "mask_max_size",
    "backend",
    # annotations: which tiles of an annotated slide are kept
    "roi",
    "exclude",
    "max_excluded",
    "annotation_objects",  # which QuPath objects are regions
    # tissue detection and quality control
    "tissue_detector",
    "tissue_masks",
    "tissue_class",
    "qc",
    "qc_exclude",
)


@dataclass(frozen=True)
class SlideTask:
    entry: SlideEntry
    stored_path: str
    config: IndexConfig
    annotations: tuple[str, ...] = ()  # the slide's annotation files (with cfg.annotations)
    tissue_mask: str | None = None  # the slide's tissue mask image (with cfg.tissue_masks)


def _empty_tiles() -> TileArrays:
    return {name: np.zeros(0, dtype=dtype) for name, dtype in TILE_COLUMNS.items()}


def index_slide(task: SlideTask) -> tuple[SlideRecord, TileArrays]:
    """Index one slide. Never raises: failures come back as ``status="failed"`` records."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        # the annotation files are parsed while the slide is opened, then measured while the
        # tissue is found: labels are the longer path, so it starts first
        reading = (
            pool.submit(read_shapes, list(task.annotations), task.config.annotation_objects)
            if task.config.annotations is not None
            else None
        )
        return _index_slide(task, pool, reading)


def _index_slide(
    task: SlideTask, pool: ThreadPoolExecutor, reading: Future[ReadShapes] | None
) -> tuple[SlideRecord, TileArrays]:
    entry, cfg = task.entry, task.config
    record = SlideRecord(path=task.stored_path, label=entry.label, split=entry.split)
    try:
        size, mtime_ns, digest, content = identify(entry.path)
        record = replace(record, size=size, mtime_ns=mtime_ns, fingerprint=digest, content=content)
        reader = open_slide(entry.path, cfg.backend)
    except SlideError as exc:
        return replace(record, status="failed", error=_reason(exc)), _empty_tiles()
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError)
        reason = "slide file does not exist" if missing else f"{exc.strerror or exc}"
        return replace(record, status="failed", error=reason), _empty_tiles()
    try:
        meta = reader.meta
        mpp = entry.mpp if entry.mpp is not None else meta.mpp
        record = replace(
            record,
            backend=meta.backend,
            vendor=meta.vendor,
            width=meta.dimensions[0],
            height=meta.dimensions[1],
            level_count=meta.level_count,
            mpp=mpp,
            mpp_source="manifest" if entry.mpp is not None else meta.mpp_source,
            objective_power=meta.objective_power,
            warning=meta.note,
        )
        plan = plan_read(
            meta,
            cfg.tile_size,
            cfg.grid_stride,
            mpp=cfg.mpp,
            level=cfg.level,
            mag=cfg.mag,
            tolerance=cfg.mpp_tolerance,
            slide_mpp=entry.mpp,
        )
        for context_mpp, size in cfg.context or ():  # each scale must be servable
            try:
                plan_read(
                    meta,
                    size,
                    size,
                    mpp=context_mpp,
                    tolerance=cfg.mpp_tolerance,
                    slide_mpp=entry.mpp,
                )
            except ResolutionError as exc:
                raise ResolutionError(f"context scale {context_mpp:g} um/px: {exc}") from exc
        disagreement = (
            mag_disagreement(meta, entry.mpp or meta.usable_mpp, cfg.mpp_tolerance)
            if cfg.mag is not None
            else None
        )
        record = replace(
            record,
            read_level=plan.level,
            read_downsample=plan.level_downsample,
            read_size=plan.read_size,
            stride=plan.l_stride,
            tile_mpp=plan.tile_mpp,
            tile_mag=plan.tile_mag,
            mag_source=plan.mag_source,
            aligned=plan.aligned,
            warning=join_notes(record.warning, disagreement, plan.warning),
        )
        l0_x, l0_y = grid(meta, plan, align=cfg.align_to_storage)
        files = list(task.annotations)
        # both paths run largely outside the GIL (GEOS, numpy, the decoder), so the second
        # core takes part of the work
        annotating = None
        if reading is not None:
            parsed = reading  # the pool has one thread: the parse is done when this starts
            annotating = pool.submit(
                lambda: annotate_slide(
                    files, cfg, meta.dimensions, l0_x, l0_y, plan.l0_footprint, parsed.result()
                )
            )
        analysis = analyse_slide(
            reader, cfg, TileBoxes(l0_x, l0_y, plan.l0_footprint), plan.level, mpp, task.tissue_mask
        )
        record = replace(record, **analysis.record)
        if task.tissue_mask is not None:
            record = replace(
                record,
                tissue_mask=task.tissue_mask,
                tissue_mask_digest=files_digest([task.tissue_mask]),
            )
        for note in analysis.notes:
            record = replace(record, warning=join_notes(record.warning, note))
        tissue = analysis.tissue
        notes_digest = None
        if annotating is not None and files:
            with contextlib.suppress(OSError):  # the annotation thread reports the file
                notes_digest = files_digest(files)
        annotated = annotating.result() if annotating is not None else None
        if annotated is not None and cfg.tissue_class is not None:
            tissue, record = _class_tissue(tissue, annotated, cfg.tissue_class, record)
        keep = tissue >= cfg.min_tissue
        if annotated is not None:
            keep &= annotated.keep
            record = replace(
                record,
                annotations=files,
                annotation_digest=notes_digest,
                class_areas=annotated.areas,
            )
            for note in annotated.notes:
                record = replace(record, warning=join_notes(record.warning, note))
        if cfg.qc_exclude and analysis.columns:
            flagged = qc.flags(analysis.columns, cfg.qc_exclude, cfg.qc_thresholds)
            dropped = np.zeros(len(keep), dtype=bool)
            for mask in flagged.values():
                dropped |= mask & keep
            excluded = {name: int((mask & keep).sum()) for name, mask in flagged.items()}
            record = replace(
                record, qc=(record.qc or {}) | {"excluded": excluded | {"any": int(dropped.sum())}}
            )
            keep &= ~dropped
        tiles: TileArrays = {
            "slide_id": np.zeros(int(keep.sum()), dtype=np.int32),  # set when assembled
            "l0_x": l0_x[keep].astype(np.int32),
            "l0_y": l0_y[keep].astype(np.int32),
            "level": np.full(int(keep.sum()), plan.level, dtype=np.int16),
            "read_size": np.full(int(keep.sum()), plan.read_size, dtype=np.int32),
            "tissue": tissue[keep].astype(np.float32),
        }
        if annotated is not None:
            tiles["coverage"] = annotated.coverage[keep]
        for name, values in analysis.columns.items():
            tiles[name] = values[keep]
        if not len(l0_x):
            record = replace(
                record, warning=join_notes(record.warning, "the slide is smaller than one tile")
            )
        elif not keep.any():
            why = "min_tissue" if annotated is None else "min_tissue and the annotation filters"
            why += " and qc_exclude" if cfg.qc_exclude else ""
            record = replace(record, warning=join_notes(record.warning, f"no tile passes {why}"))
        return replace(record, tiles=int(keep.sum())), tiles
    except SlideError as exc:
        return replace(record, status="failed", error=_reason(exc)), _empty_tiles()
    except AnnotationError as exc:
        return replace(record, status="failed", error=f"annotations: {exc}"), _empty_tiles()
    except InputError as exc:  # the user's tissue mask
        return replace(record, status="failed", error=str(exc)), _empty_tiles()
    except Exception as exc:  # a malformed file must not stop the run
        log.debug("indexing %s failed", entry.path, exc_info=True)
        return replace(
            record, status="failed", error=f"{type(exc).__name__}: {exc}"
        ), _empty_tiles()
    finally:
        reader.close()


def _class_tissue(
    tissue: FloatArray, annotated: SlideAnnotations, name: str, record: SlideRecord
) -> tuple[FloatArray, SlideRecord]:
    """The share of each tile the annotation class ``name`` covers, as its tissue; a slide
    without that class keeps what the pixels say, with a note."""
    classes = list(annotated.areas)
    if name not in classes:
        note = f"no {name!r} annotation (tissue_class): tissue found by {record.tissue_detector}"
        return tissue, replace(record, warning=join_notes(record.warning, note))
    share = annotated.coverage[:, classes.index(name)].astype(np.float32)
    return share, replace(record, tissue_detector="annotation", tissue_reason=f"class {name!r}")


def _reason(exc: SlideError) -> str:
    """The error without its leading path (the record already names the slide)."""
    reason = str(exc)
    if exc.path and reason.startswith(f"{exc.path}: "):
        return reason[len(exc.path) + 2 :]
    return reason


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


def _previous(out: str, config: IndexConfig) -> SlideIndex | None:
    """The existing index at ``out`` if its grid parameters match ``config``."""
    if not os.path.exists(os.path.join(out, CURRENT)):
        return None
    index = SlideIndex.open(out)
    wanted = config.model_dump()
    built = {**IndexConfig().model_dump(), **index.params}  # older indexes lack newer keys
    # min_coverage picks tiles only through roi; otherwise it only relabels (no re-read)
    params = GRID_PARAMS + (("min_coverage",) if built["roi"] or wanted["roi"] else ())
    # QC thresholds pick tiles only through qc_exclude; otherwise they only change counts
    params += ("qc_thresholds",) if built["qc_exclude"] or wanted["qc_exclude"] else ()
    # compared as stored (JSON: tuples of the config are lists in meta.json)
    changed = [k for k in params if _as_stored(built.get(k)) != _as_stored(wanted.get(k))]
    if changed:
        log.info("grid parameters changed (%s): re-indexing every slide", ", ".join(changed))
        return None
    if config.qc != "none" and not all(name in index.columns for name in qc.QC_COLUMNS):
        log.info("the index has no quality-control columns: re-indexing every slide")
        return None
    return index


def _as_stored(value: Any) -> Any:
    """A parameter as meta.json holds it."""
    return json.loads(json.dumps(value))


FAILED_SAID = 10  # failed slides said one by one at the end of a build; the rest are counted
SHRINK_LIMIT = 0.5  # a rebuild may lose at most this share of the indexed slides unasked


def _check_shrink(out: str, records: list[SlideRecord], allowed: bool) -> None:
    """Refuse a rebuild that would lose most of the slides the index has (an archive half
    unmounted, a wrong glob), unless ``allow_shrink``."""
    if allowed or not os.path.exists(os.path.join(out, CURRENT)):
        return
    try:
        before = {s.path for s in SlideIndex.open(out).slides if s.status == "ok"}
    except IndexFormatError:
        return  # an unreadable index is rebuilt
    after = {r.path for r in records if r.status == "ok"}
    lost = before - after
    if before and len(lost) > SHRINK_LIMIT * len(before):
        first = ", ".join(sorted(lost)[:3])
        raise InputError(
            f"this rebuild would drop {len(lost)} of the {len(before)} indexed slides ({first}"
            f"{', ...' if len(lost) > 3 else ''}), so {out} was left as it is; check that the "
            "inputs are all there, or pass --allow-shrink (allow_shrink=True) to accept it"
        )


def _check_labels(report: LabelReport, labels: str, strict: bool) -> None:
    """Log (or with ``strict``, raise) labels rows that matched no slide and unlabelled slides."""
    problems = []
    if report.unmatched_rows:
        first = ", ".join(report.unmatched_rows[:5])
        problems.append(f"{len(report.unmatched_rows)} labels rows match no slide ({first})")
    if report.unlabelled_slides:
        first = ", ".join(os.path.basename(p) for p in report.unlabelled_slides[:5])
        problems.append(f"{len(report.unlabelled_slides)} slides have no label ({first})")
    if not problems:
        return
    if strict:
        raise InputError("; ".join(problems) + " (strict_labels is set)", path=labels)
    log.warning("%s: %s", labels, "; ".join(problems))


def _say_failures(records: list[SlideRecord], out: str) -> None:
    """One WARNING per failed slide up to `FAILED_SAID`, one for the rest (an archive with
    3% unreadable slides has hundreds; `wsi-loader info DIR --failed` lists them all), and
    one per slide indexed with a warning."""
    failed = [r for r in records if r.status == "failed"]
    for record in failed[:FAILED_SAID]:
        log.warning("cannot index %s: %s", record.path, record.error)
    if len(failed) > FAILED_SAID:
        log.warning(
            "... and %d more slides could not be indexed (all of them: wsi-loader info %s "
            "--failed, or the failed records of SlideIndex.slides)",
            len(failed) - FAILED_SAID,
            shlex.quote(out),
        )
    for record in records:
        if record.status != "failed" and record.warning:
            log.warning("%s: %s", record.path, record.warning)


def _check_splits(records: list[SlideRecord], root: str | None) -> None:
    """Splits are by slide: the same slide (a copy of one file under another name) in two
    splits is an error."""
    if len({r.split for r in records if r.split is not None}) < 2:
        return
    seen: dict[str, SlideRecord] = {}
    for record in records:
        if record.split is None:
            continue
        key = record.content  # recorded when indexed; older records lack it
        if key is None:
            path = record.path if root is None else os.path.join(root, record.path)
            try:
                key = content_key(path)
            except (OSError, SlideError):
                continue
        other = seen.setdefault(key, record)
        if other.split != record.split:
            raise InputError(
                f"the same slide is in two splits: {other.path} ({other.split!r}) and "
                f"{record.path} ({record.split!r}) have identical contents"
            )


def _copies(records: list[SlideRecord]) -> list[list[str]]:
    """Groups of indexed slides with identical contents (a copy, a symlink, a second
    download of one scan), and say so: each copy's tiles are in the index, so a split made
    by slide id afterwards would put the same tissue on both sides."""
    by_content: dict[str, list[str]] = {}
    for record in records:
        if record.status == "ok" and record.content is not None:
            by_content.setdefault(record.content, []).append(record.path)
    groups = sorted(sorted(paths) for paths in by_content.values() if len(paths) > 1)
    if groups:
        log.warning(
            "%d slides have the same contents as another (copies or links of one scan): %s. "
            "Each copy's tiles are in the index, so a split by slide id would put the same "
            "tissue on both sides; remove the copies, or give them one split",
            sum(len(group) - 1 for group in groups),
            describe_copies(groups),
        )
    return groups


def describe_copies(groups: list[list[str]], groups_shown: int = 5, names_shown: int = 3) -> str:
    """Groups of copies as one readable line: a few names of a few groups (a copied archive
    has thousands)."""

    def group_text(group: list[str]) -> str:
        more = f" and {len(group) - names_shown} more" if len(group) > names_shown else ""
        return " = ".join(group[:names_shown]) + more

    more = f"; and {len(groups) - groups_shown} more groups" if len(groups) > groups_shown else ""
    return "; ".join(group_text(group) for group in groups[:groups_shown]) + more


def _same_annotations(record: SlideRecord, files: tuple[str, ...], cfg: IndexConfig) -> bool:
    """Whether a carried-over slide's annotations are still what they were when indexed."""
    if cfg.annotations is None:
        return True  # its coverage is dropped
    if record.class_areas is None or tuple(record.annotations or ()) != files:
        return False
    try:
        return record.annotation_digest == (files_digest(files) if files else None)
    except OSError:
        return False


def _same_mask(record: SlideRecord, mask: str | None) -> bool:
    """Whether a carried-over slide's tissue mask is still the one it was indexed with."""
    if mask != record.tissue_mask:
        return False
    if mask is None:
        return True
    try:
        return record.tissue_mask_digest == files_digest([mask])
    except OSError:
        return False


def _with_qc_columns(arrays: TileArrays) -> TileArrays:
    """``arrays`` with every QC column (NaN where a slide has none: a failed slide)."""
    rows = len(arrays["l0_x"])
    missing = {
        name: np.full(rows, np.nan, dtype=dtype)
        for name, dtype in qc.QC_COLUMNS.items()
        if name not in arrays
    }
    return {**arrays, **missing} if missing else arrays


def _warn_masks(report: MaskReport, source: str, detector: str) -> None:
    if report.unmatched_files:
        first = ", ".join(os.path.basename(f) for f in report.unmatched_files[:5])
        log.warning(
            "%s: %d tissue masks match no slide (%s)", source, len(report.unmatched_files), first
        )
    if report.slides_without:
        first = ", ".join(os.path.basename(p) for p in report.slides_without[:5])
        log.warning(
            "%d slides have no tissue mask; their tissue is found by the %s detector (%s)",
            len(report.slides_without),
            detector,
            first,
        )


def _warn_dark_field(records: list[SlideRecord], forced: str) -> None:
    """Say which slides were found to be dark field (fluorescence) and had their tissue found
    by intensity: a brightfield archive with black margins would want to know."""
    if forced != "auto":
        return
    dark = [r.path for r in records if r.status == "ok" and r.tissue_detector == "fluorescence"]
    if dark:
        log.warning(
            "%d slide%s look%s dark field (fluorescence), so tissue was found by intensity "
            "instead of colour: %s%s (to find tissue by colour on them anyway, set "
            "tissue_detector: brightfield, or --tissue-detector brightfield)",
            len(dark),
            "s" if len(dark) != 1 else "",
            "" if len(dark) != 1 else "s",
            ", ".join(os.path.basename(p) for p in dark[:5]),
            ", ..." if len(dark) > 5 else "",
        )


def _warn_annotations(report: AnnotationReport, source: str) -> None:
    if report.unmatched_files:
        first = ", ".join(os.path.basename(f) for f in report.unmatched_files[:5])
        log.warning(
            "%s: %d annotation files match no slide (%s)",
            source,
            len(report.unmatched_files),
            first,
        )
    if report.slides_without:
        first = ", ".join(os.path.basename(p) for p in report.slides_without[:5])
        log.warning("%d slides have no annotation file (%s)", len(report.slides_without), first)


def _check_class_names(
    cfg: IndexConfig, tasks: list[SlideTask], carried: list[SlideRecord]
) -> None:
    """A class named in an option must be in some annotation file: a typo would otherwise
    silently keep no tile (roi) or drop none (exclude). Checked before any slide is read;
    files that fail to parse fail their slide later, with the reason."""
    named = {
        "roi": cfg.roi,
        "exclude": cfg.exclude,
        "class_priority": cfg.class_priority,
        "tissue_class": [cfg.tissue_class] if cfg.tissue_class else [],
    }
    if not any(named.values()):
        return
    found: set[str] = set()
    for record in carried:
        found.update(record.class_areas or {})
    for file in sorted({f for task in tasks for f in task.annotations}):
        try:
            parsed = read_annotations(file, cfg.annotation_objects)
            found.update(shape.name for shape in parsed.shapes)
        except AnnotationError:
            continue
    for option, names in named.items():
        missing = [n for n in names if n not in found]
        if missing:
            raise InputError(
                f"{option}: no annotation file has the class(es) {missing}; the classes found "
                f"are {sorted(found) or 'none'}. Nothing was written"
            )


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
        arrays = dict(found) if found else _empty_tiles()
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
            given_up=_given_up,
        )


def _given_up(task: SlideTask, why: GivenUp) -> tuple[SlideRecord, TileArrays]:
    """The record of a slide its worker process did not finish: not done within
    ``slide_timeout`` (the worker was ended), or the worker died under it."""
    if why.kind == "timeout":
        error = (
            f"not done after {why.detail} s (slide_timeout), so given up: the slide is slow "
            "to open or read, or its storage stopped answering"
        )
    else:
        error = f"its worker process died while indexing it ({why.detail}); not indexed"
    entry = task.entry
    record = SlideRecord(
        path=task.stored_path, label=entry.label, split=entry.split, status="failed", error=error
    )
    return record, _empty_tiles()


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
        raise InputError(
            f"none of the inputs exists ({', '.join(names[:3])}); is the share mounted? "
            "Nothing was written"
        )
    label_report = None
    if cfg.labels:
        entries, label_report = join_labels(entries, cfg.labels)
        _check_labels(label_report, cfg.labels, cfg.strict_labels)
    warn_similar({e.label for e in entries if e.label is not None}, "labels")
    warn_missing_spelt([e.label for e in entries if e.label is not None])
    files_of: dict[str, tuple[str, ...]] = {}
    annotation_report = None
    if cfg.annotations is not None:
        files_of, annotation_report = match_annotations(entries, cfg.annotations)
        _warn_annotations(annotation_report, cfg.annotations)
    elif any(e.annotations for e in entries):
        log.warning(
            "the manifest's 'annotations' column is only read with annotations set: pass the "
            "manifest as --annotations (annotations=...) to use it"
        )
    masks: dict[str, str] = {}
    if cfg.tissue_masks is not None:
        masks, mask_report = match_masks(entries, cfg.tissue_masks)
        _warn_masks(mask_report, cfg.tissue_masks, cfg.tissue_detector)
    previous = _previous(out, cfg)
    old = records_by_path(previous) if previous else {}
    old_classes = list(previous.classes) if previous else []

    slots: list[tuple[SlideRecord, TileArrays] | SlideTask] = []
    reused = 0
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
            and _same_annotations(hit[1], files, cfg)
            and stain_is_current(hit[1].stain, hit[1].stain_error)  # else: an older estimate
            and _same_mask(hit[1], masks.get(entry.path))
        ):
            try:
                digest: str | None = fingerprint(entry.path)[2]
            except (OSError, SlideError):
                digest = None
            if digest == hit[1].fingerprint:
                record = replace(hit[1], label=entry.label, split=entry.split)
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
    if cfg.annotations is not None:
        _check_class_names(cfg, tasks, [s[0] for s in slots if not isinstance(s, SlideTask)])
    had_ok = previous is not None and any(r.status == "ok" for r in previous.slides)
    del previous  # releases its generation, which write_index may then delete
    done = iter(_run(tasks, cfg, executor, progress))
    results = [next(done) if isinstance(s, SlideTask) else s for s in slots]
    results.sort(key=lambda r: r[0].path)
    if cfg.qc != "none":  # failed slides too: a column is written when every slide has it
        results = [(record, _with_qc_columns(arrays)) for record, arrays in results]
    _warn_dark_field([record for record, _ in results], cfg.tissue_detector)
    _say_failures([record for record, _ in results], out)
    if had_ok and not any(record.status == "ok" for record, _ in results):
        raise InputError(
            f"no slide could be indexed, so the index in {out} was left as it is "
            "(see the warnings above for each slide's reason)"
        )
    _check_shrink(out, [record for record, _ in results], cfg.allow_shrink)
    _check_splits([record for record, _ in results], root)
    extra: dict[str, Any] = {
        "copies": _copies([record for record, _ in results]),
        "build": {"unchanged": reused, "indexed": len(tasks)},  # what this build did
    }
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
