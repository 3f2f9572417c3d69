"""Everything the builder learns about a slide from its low-resolution picture, in one place.

`analyse_slide` reads the picture once (`LowResolution`: the lowest level, shrunk to
``mask_max_size``) and runs every per-slide analysis over it: the tissue detector chosen for
the slide (or the user's mask), the tissue fraction of each tile, the stain estimate
(`_stain_estimates`) and quality control (`_qc`). A new analysis of the same pixels goes
here too, so no slide is read twice and the builder stays one call.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from wsi_loader.config import IndexConfig
from wsi_loader.errors import TileReadError
from wsi_loader.index import _qc as qc
from wsi_loader.index._focus import measure_sharpness
from wsi_loader.index._lowres import FloatArray, LowResolution, TileBoxes
from wsi_loader.index._stain_estimates import StainEstimate
from wsi_loader.index._stain_sampling import stain_columns
from wsi_loader.index._table_files import SlideRecord
from wsi_loader.index._tissue import (
    DARK_FIELD_BRIGHTNESS,
    BoolArray,
    Detector,
    choose_detector,
    max_hole_pixels,
    pixel_rule,
    read_mask_image,
    tile_fractions,
    tissue_mask,
    typical_brightness,
)
from wsi_loader.index._tissue_masks import read_mask
from wsi_loader.index.annotations import read_regions
from wsi_loader.slides._base import MAX_PLAUSIBLE_MPP, MIN_PLAUSIBLE_MPP, SlideReader

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
    # a forced detector that does not fit the slide's picture finds the wrong thing: said
    # both ways (on bright glass, fluorescence's "what glows" is the glass too)
    if cfg.tissue_detector == "brightfield" and "(dark field" in why:
        result.notes.append(
            f"the slide looks dark field (fluorescence: typical brightness under "
            f"{DARK_FIELD_BRIGHTNESS}/255), but tissue_detector is brightfield, which finds "
            "tissue by colour on a bright background: use tissue_detector auto or fluorescence"
        )
    if cfg.tissue_detector == "fluorescence" and "(bright field" in why:
        result.notes.append(
            f"the slide looks bright field (typical brightness {typical_brightness(image):.0f}"
            f"/255, dark field is under {DARK_FIELD_BRIGHTNESS}), but tissue_detector is "
            "fluorescence, which finds tissue as what is bright "
            "on black glass, so bright glass counts as tissue: use tissue_detector auto or "
            "brightfield"
        )
    plausible = (  # a resolution no microscope has (72 dpi from generic software) misleads
        mpp if mpp is not None and MIN_PLAUSIBLE_MPP <= mpp <= MAX_PLAUSIBLE_MPP else None
    )
    per_px = meta.dimensions[0] / image.shape[1]  # level-0 pixels per pixel of the picture
    max_hole = max_hole_pixels(
        None if plausible is None else plausible * per_px, tiles.footprint / per_px
    )
    mask = tissue_mask(image, rule, max_hole)
    if detector == "fluorescence":
        result.record |= {"stain": None, "stain_error": "a fluorescence slide has no H&E stain"}
    else:
        result.record |= stain_columns(reader, image, mask, level, read_level)  # its own tissue
        stain = result.record.get("stain")
        note = None if stain is None else StainEstimate.from_json(stain).not_he()
        if note is not None:
            result.notes.append(note)
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
        # without a plausible scale, the QC picture goes by tiles; its glass is what the
        # tissue mask (the tissue column's) does not cover
        found = qc.measure(low, rule, tiles, plausible, sharpness, mask)
        if found.summary.get("blue_stain"):
            result.notes.append(
                "most of the tissue is blue (a Giemsa or other blue stain, not H&E?): blue "
                "is taken as the stain, not as pen ink"
            )
        result.columns |= found.columns
        result.record["qc"] = found.summary
    return result


def recorded_tissue_mask(
    reader: SlideReader, record: SlideRecord, params: Mapping[str, Any]
) -> BoolArray:
    """The tissue mask of an indexed slide as its build found the tissue, for drawing: by
    the detector recorded for the slide (``brightfield``, ``fluorescence``; an index older
    than the record: brightfield, the only rule then), the user's mask image (``mask``,
    shrunk to the picture's size) or the regions of the annotation class (``annotation``:
    the class's outline, before overlaps with other classes are settled). At most
    ``mask_max_size`` on its longer side. Raises `InputError` / `AnnotationError` when a
    mask image or annotation file cannot be read any more, `SlideError` for the slide."""
    max_size = int(params.get("mask_max_size") or 2048)
    size = (record.width or reader.meta.dimensions[0], record.height or reader.meta.dimensions[1])
    if record.tissue_detector == "mask" and record.tissue_mask:
        mask = read_mask(record.tissue_mask, size)
        factor = max(1, math.ceil(max(mask.shape) / max_size))
        if factor == 1:
            return mask
        shrunk = Image.fromarray(mask.astype(np.uint8) * 255).reduce(factor)
        small: BoolArray = np.asarray(shrunk) > 127
        return small
    image, _ = read_mask_image(reader, max_size)
    if record.tissue_detector == "annotation" and record.annotations:
        name = params.get("tissue_class")
        objects = params.get("annotation_objects") or ()
        regions = read_regions(record.annotations, size[0], size[1], objects)
        geometry = regions.classes.get(name) if isinstance(name, str) else None
        return _drawn(geometry, image.shape[:2], size)
    fluorescence = record.tissue_detector == "fluorescence"
    detector: Detector = "fluorescence" if fluorescence else "brightfield"
    mpp = reader.meta.usable_mpp
    per_px = size[0] / image.shape[1]
    tile_px = float(params.get("tile_size") or 256) / per_px
    max_hole = max_hole_pixels(None if mpp is None else mpp * per_px, tile_px)
    return tissue_mask(image, pixel_rule(image, detector), max_hole)


def _drawn(geometry: Any, shape: tuple[int, ...], l0_size: tuple[int, int]) -> BoolArray:
    """Polygons (level-0 coordinates, holes included) filled into a mask of ``shape``."""
    height, width = shape
    canvas = Image.new("1", (width, height), 0)
    if geometry is None or geometry.is_empty:
        return np.asarray(canvas, dtype=bool)
    draw = ImageDraw.Draw(canvas)
    sx, sy = width / l0_size[0], height / l0_size[1]

    def points(ring: Any) -> list[tuple[float, float]]:
        return [(x * sx, y * sy) for x, y, *_ in ring.coords]

    for polygon in getattr(geometry, "geoms", [geometry]):
        if polygon.geom_type != "Polygon":
            continue
        draw.polygon(points(polygon.exterior), fill=1)
        for hole in polygon.interiors:
            draw.polygon(points(hole), fill=0)
    return np.asarray(canvas, dtype=bool)
