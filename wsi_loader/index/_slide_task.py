"""One slide's indexing: open it, choose the resolution, lay the grid and fill its columns.

Each slide is indexed by `index_slide`, a plain function of small picklable arguments that
returns the slide's record and coordinate arrays, so it runs inline, in a process pool, or on
any ``concurrent.futures.Executor`` (a Dask cluster's ``client.get_executor()``). It never
raises: a slide that cannot be indexed comes back as a failed record with the reason, and a
slide its worker did not finish (`given_up`) is made a failed record here too.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from wsi_loader.config import IndexConfig
from wsi_loader.errors import AnnotationError, InputError, ResolutionError, SlideError
from wsi_loader.index import _qc as qc
from wsi_loader.index._analyses import analyse_slide
from wsi_loader.index._fingerprints import identify
from wsi_loader.index._geometry import grid, mag_disagreement, plan_read
from wsi_loader.index._inputs import SlideEntry
from wsi_loader.index._lowres import FloatArray, TileBoxes
from wsi_loader.index._table_files import TILE_COLUMNS, SlideRecord, TileArrays
from wsi_loader.index.annotations import files_digest
from wsi_loader.index.annotations._regions import ReadShapes, read_shapes
from wsi_loader.index.annotations._tiles import SlideAnnotations, annotate_slide
from wsi_loader.parallel import GivenUp
from wsi_loader.slides._base import join_notes
from wsi_loader.slides._open import open_slide

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlideTask:
    entry: SlideEntry
    stored_path: str
    config: IndexConfig
    annotations: tuple[str, ...] = ()  # the slide's annotation files (with cfg.annotations)
    tissue_mask: str | None = None  # the slide's tissue mask image (with cfg.tissue_masks)


def empty_tiles() -> TileArrays:
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
    record = SlideRecord(
        path=task.stored_path, label=entry.label, split=entry.split, patient=entry.patient
    )
    try:
        size, mtime_ns, digest, content = identify(entry.path)
        record = replace(record, size=size, mtime_ns=mtime_ns, fingerprint=digest, content=content)
        reader = open_slide(entry.path, cfg.backend)
    except SlideError as exc:
        return replace(record, status="failed", error=_reason(exc)), empty_tiles()
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError)
        reason = "slide file does not exist" if missing else f"{exc.strerror or exc}"
        return replace(record, status="failed", error=reason), empty_tiles()
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
        return replace(record, status="failed", error=_reason(exc)), empty_tiles()
    except AnnotationError as exc:
        return replace(record, status="failed", error=f"annotations: {exc}"), empty_tiles()
    except InputError as exc:  # the user's tissue mask
        return replace(record, status="failed", error=str(exc)), empty_tiles()
    except Exception as exc:  # a malformed file must not stop the run
        log.debug("indexing %s failed", entry.path, exc_info=True)
        return replace(record, status="failed", error=f"{type(exc).__name__}: {exc}"), empty_tiles()
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


def given_up(task: SlideTask, why: GivenUp) -> tuple[SlideRecord, TileArrays]:
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
        path=task.stored_path,
        label=entry.label,
        split=entry.split,
        patient=entry.patient,
        status="failed",
        error=error,
    )
    return record, empty_tiles()
