"""Incremental rebuilds: whether the index being replaced may be reused at all (its grid
parameters), and whether a slide of it is still what it was indexed with (its annotations,
its tissue mask), so that it is carried over without being opened. The carry-over itself
(the slide's fingerprint compared, its tiles taken from the old generation) is a step of
`_builder._build`, as is keeping the splits `wsi-loader split` wrote (`kept_splits`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from wsi_loader.config import IndexConfig
from wsi_loader.index import _qc as qc
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import CURRENT, SlideRecord
from wsi_loader.index.annotations import files_digest

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


def previous(out: str, config: IndexConfig) -> SlideIndex | None:
    """The existing index at ``out`` if its grid parameters match ``config``."""
    if not os.path.exists(os.path.join(out, CURRENT)):
        return None
    index = SlideIndex.open(out)
    changed = [key for key, _, _ in changed_grid(index.params, config)]
    if changed:
        log.info("grid parameters changed (%s): re-indexing every slide", ", ".join(changed))
        return None
    if config.qc != "none" and not all(name in index.columns for name in qc.QC_COLUMNS):
        log.info("the index has no quality-control columns: re-indexing every slide")
        return None
    return index


def changed_grid(params: dict[str, Any], config: IndexConfig) -> list[tuple[str, Any, Any]]:
    """The grid parameters (`GRID_PARAMS`) an index built with ``params`` (its meta.json's)
    lays otherwise than ``config`` would: (name, value built with, value wanted), as stored."""
    wanted = config.model_dump()
    built = {**IndexConfig().model_dump(), **params}  # older indexes lack newer keys
    # min_coverage picks tiles only through roi; otherwise it only relabels (no re-read)
    names = GRID_PARAMS + (("min_coverage",) if built["roi"] or wanted["roi"] else ())
    # QC thresholds pick tiles only through qc_exclude; otherwise they only change counts
    names += ("qc_thresholds",) if built["qc_exclude"] or wanted["qc_exclude"] else ()
    # compared as stored (JSON: tuples of the config are lists in meta.json)
    pairs = [(k, _as_stored(built.get(k)), _as_stored(wanted.get(k))) for k in names]
    return [(k, was, now) for k, was, now in pairs if was != now]


def kept_splits(
    out: str, previous: SlideIndex | None
) -> tuple[dict[str, str], dict[str, Any] | None]:
    """The splits `wsi-loader split` wrote into the index at ``out``, by stored slide path
    and by content (``content:<digest>``: a slide found under another path, an archive moved
    and indexed where it is now, keeps its split), and its plan: a rebuild keeps them for the
    slides whose inputs give no split (whether the slides' tiles are reused or read again).
    Empty for an index never split so: the splits of its slides then came from its inputs
    alone. ``previous``: the index at ``out`` when it is open already (grid parameters
    unchanged)."""
    if previous is None and not os.path.exists(os.path.join(out, CURRENT)):
        return {}, None
    index = previous if previous is not None else SlideIndex.open(out)
    plan = index.meta.get("splits")
    if not isinstance(plan, dict):
        return {}, None
    by_content: dict[str, set[str]] = {}
    for r in index.slides:
        if r.split is not None and r.content is not None:
            by_content.setdefault(f"content:{r.content}", set()).add(r.split)
    kept = {key: next(iter(found)) for key, found in by_content.items() if len(found) == 1}
    return {**kept, **{r.path: r.split for r in index.slides if r.split is not None}}, plan


def _as_stored(value: Any) -> Any:
    """A parameter as meta.json holds it."""
    return json.loads(json.dumps(value))


def same_annotations(record: SlideRecord, files: tuple[str, ...], cfg: IndexConfig) -> bool:
    """Whether a carried-over slide's annotations are still what they were when indexed."""
    if cfg.annotations is None:
        return True  # its coverage is dropped
    if record.class_areas is None or tuple(record.annotations or ()) != files:
        return False
    try:
        return record.annotation_digest == (files_digest(files) if files else None)
    except OSError:
        return False


def same_mask(record: SlideRecord, mask: str | None) -> bool:
    """Whether a carried-over slide's tissue mask is still the one it was indexed with."""
    if mask != record.tissue_mask:
        return False
    if mask is None:
        return True
    try:
        return record.tissue_mask_digest == files_digest([mask])
    except OSError:
        return False
