"""Everything the builder learns about a slide from its low-resolution picture, in one place.

`analyse_slide` reads the picture once (`LowResolution`: the lowest level, shrunk to
``mask_max_size``) and runs every per-slide analysis over it: the tissue detector chosen for
the slide (or the user's mask), the tissue fraction of each tile, the stain estimate
(`index/stain.py`) and quality control (`index/qc.py`). A new analysis of the same pixels goes
here too, so no slide is read twice and the builder stays one call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wsi_loader.config import IndexConfig
from wsi_loader.errors import TileReadError
from wsi_loader.index import qc
from wsi_loader.index.focus import measure_sharpness
from wsi_loader.index.lowres import FloatArray, LowResolution, TileBoxes
from wsi_loader.index.stain import stain_columns
from wsi_loader.index.tissue import (
    DARK_FIELD_BRIGHTNESS,
    choose_detector,
    pixel_rule,
    read_mask_image,
    tile_fractions,
    tissue_mask,
)
from wsi_loader.index.tissue_masks import read_mask
from wsi_loader.slides.base import MAX_PLAUSIBLE_MPP, MIN_PLAUSIBLE_MPP, SlideReader

log = logging.getLogger(__name__)


def _reason(exc: TileReadError) -> str:
    """The error without its leading path (the slide's record names it)."""
    reason = str(exc)
    return (
        reason[len(exc.path) + 2 :] if exc.path and reason.startswith(f"{exc.path}: ") else reason
    )


@dataclass
class SlideAnalysis:
    """What the picture says about a slide: per grid tile ``tissue`` and extra ``columns``,
    fields of its `SlideRecord` (``record``), and notes worth a warning."""

    tissue: FloatArray
    columns: dict[str, FloatArray] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def analyse_slide(
    reader: SlideReader,
    cfg: IndexConfig,
    tiles: TileBoxes,
    read_level: int,
    mpp: float | None,
    mask_file: str | None = None,
) -> SlideAnalysis:
    """Tissue, stain and quality control of ``tiles`` (every grid tile of the slide)."""
    if not len(tiles):
        nothing = {"stain": None, "stain_error": "the slide is smaller than one tile"}
        return SlideAnalysis(np.ones(0, dtype=np.float32), record=nothing)
    meta = reader.meta
    try:
        image, level = read_mask_image(reader, cfg.mask_max_size)
    except TileReadError as exc:
        if cfg.min_tissue > 0 or cfg.tissue_masks is not None:
            raise  # no tissue without the picture: the slide fails with the reason
        # every tile stays (min_tissue 0), unmeasured: the picture flags stain and QC only
        result = SlideAnalysis(np.ones(len(tiles), dtype=np.float32))
        unreadable = f"low-resolution image unreadable: {_reason(exc)}"
        result.record = {"stain": None, "stain_error": unreadable}
        if cfg.qc != "none":
            nan = {name: np.full(len(tiles), np.nan, np.float32) for name in qc.QC_COLUMNS}
            result.columns = nan
            result.notes.append(f"no quality control: {unreadable}")
        return result
    low = LowResolution(image, level, meta.dimensions)
    detector, why = choose_detector(image, cfg.tissue_detector)
    rule = pixel_rule(image, detector)
    result = SlideAnalysis(np.ones(len(tiles), dtype=np.float32))
    result.record = {"mask_level": level, "tissue_detector": detector, "tissue_reason": why}
    if cfg.tissue_detector == "brightfield" and "dark field" in why:
        result.notes.append(
            f"the slide looks dark field (fluorescence: typical brightness under "
            f"{DARK_FIELD_BRIGHTNESS}/255), but tissue_detector is brightfield, which finds "
            "tissue by colour on a bright background: use tissue_detector auto or fluorescence"
        )
    mask = tissue_mask(image, rule)
    if detector == "fluorescence":
        result.record |= {"stain": None, "stain_error": "a fluorescence slide has no H&E stain"}
    else:
        result.record |= stain_columns(reader, image, mask, level, read_level)  # its own tissue
    if mask_file is not None:
        mask = read_mask(mask_file, meta.dimensions)
        result.record |= {"tissue_detector": "mask", "tissue_reason": f"mask image {mask_file}"}
    result.tissue = tile_fractions(mask, meta.dimensions, tiles.l0_x, tiles.l0_y, tiles.footprint)
    if cfg.qc != "none":
        try:
            sharpness = measure_sharpness(reader, read_level, tiles)
        except TileReadError as exc:  # the fallback reads pixels; focus is then unknown
            sharpness = None
            result.notes.append(f"no focus measure: {exc}")
        # a resolution no microscope has (72 dpi from generic software) would mislead the
        # QC picture's scale: without one, it goes by tiles
        plausible = (
            mpp if mpp is not None and MIN_PLAUSIBLE_MPP <= mpp <= MAX_PLAUSIBLE_MPP else None
        )
        found = qc.measure(low, rule, tiles, plausible, sharpness)
        result.columns |= found.columns
        result.record["qc"] = found.summary
    return result
