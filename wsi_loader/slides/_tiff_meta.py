"""The slide metadata a TIFF's tags state (MPP from the resolution tags, an OME-XML
description or Aperio's; the objective power; the channels left unread), gathered into the
tifffile backend's `SlideMeta` by `read_meta`."""

from __future__ import annotations

import logging
import math
import re

import tifffile
from defusedxml import DefusedXmlException
from defusedxml.ElementTree import fromstring as xml_from_text

from wsi_loader.slides._base import MppSource, SlideMeta, join_notes, non_square_note
from wsi_loader.slides._tiff_decode import Level

log = logging.getLogger(__name__)

_UNIT_TO_UM = {2: 25400.0, 3: 10000.0}  # ResolutionUnit inch / centimetre -> micrometres
# OME UnitsLength symbols -> micrometres (OME's default unit is the micrometre)
_OME_UNIT_TO_UM = {
    "m": 1e6,
    "dm": 1e5,
    "cm": 1e4,
    "mm": 1e3,
    "\u00b5m": 1.0,  # micro sign, the spelling OME's schema uses
    "\u03bcm": 1.0,  # Greek mu
    "um": 1.0,
    "nm": 1e-3,
    "pm": 1e-6,
    "\u00c5": 1e-4,  # angstrom
    "in": 25400.0,
}


def resolution_mpp(page: tifffile.TiffPage, axis: str = "X") -> float | None:
    """MPP from the X/YResolution and ResolutionUnit tags, None when absent or unit-less."""
    res = page.tags.get(f"{axis}Resolution")
    unit = page.tags.get("ResolutionUnit")
    if res is None or unit is None or int(unit.value) not in _UNIT_TO_UM:
        return None
    num, den = res.value
    if num <= 0 or den <= 0:
        return None
    return float(_UNIT_TO_UM[int(unit.value)] * den / num)


def ome_mpps(xml: str | None) -> tuple[float | None, float | None]:
    """MPP across and down from an OME-XML description: the first image's ``PhysicalSizeX``
    and ``PhysicalSizeY`` in their units. None when absent, not a length (``pixel``), or
    unreadable: a bad description is not a bad slide."""
    if not xml:
        return None, None
    try:
        root = xml_from_text(xml)
    except (SyntaxError, ValueError, DefusedXmlException) as exc:  # ParseError is a SyntaxError
        log.debug("OME-XML not readable (%s): no pixel size from it", exc)
        return None, None
    pixels = next((e for e in root.iter() if e.tag.rpartition("}")[2] == "Pixels"), None)
    if pixels is None:
        return None, None

    def size(axis: str) -> float | None:
        value = pixels.get(f"PhysicalSize{axis}")
        scale = _OME_UNIT_TO_UM.get(pixels.get(f"PhysicalSize{axis}Unit", "\u00b5m").strip())
        try:
            mpp = float(value) * scale if value is not None and scale is not None else None
        except ValueError:
            return None
        return mpp if mpp is not None and math.isfinite(mpp) and mpp > 0 else None

    return size("X"), size("Y")


def aperio_field(description: str, name: str) -> float | None:
    """A number from an Aperio ImageDescription (``...|MPP = 0.4990|AppMag = 20|...``)."""
    match = re.search(rf"\|\s*{name}\s*=\s*([0-9.]+)", description)
    try:
        return float(match.group(1)) if match else None
    except ValueError:
        return None


def channels_note(series: tifffile.TiffPageSeries, page: tifffile.TiffPage) -> str | None:
    """Say so when the series holds more than the page read: one grey page per channel
    (multiplex fluorescence: only the first channel is read, as grey), or several pages of
    another kind (a stack of RGB images: the first is read, in colour)."""
    per_page = math.prod(page.shape)
    count = math.prod(series.shape) // per_page if per_page else 1
    if count <= 1:
        return None
    if int(page.samplesperpixel) >= 3:
        return f"{count} images ({series.axes}); only the first is read, in colour"
    return f"{count} channels ({series.axes}); only channel 0 is read, as grey"


def read_meta(
    backend: str,
    levels: list[Level],
    series: tifffile.TiffPageSeries,
    base_page: tifffile.TiffPage,
    ome: str | None,
) -> SlideMeta:
    """The `SlideMeta` of a parsed file: its levels' geometry, and what the base page's tags
    (and the OME-XML, ``ome``) say of its pixel size."""
    base = levels[0]
    mpp, mpp_y = resolution_mpp(base_page), resolution_mpp(base_page, "Y")
    source: MppSource = "tiff-resolution" if mpp is not None else "missing"
    ome_mpp, ome_mpp_y = ome_mpps(ome)
    if ome_mpp is not None:  # the writer's own statement; resolution tags are often 72 dpi
        mpp, mpp_y, source = ome_mpp, ome_mpp_y, "vendor"
    objective = None
    vendor = {"generic": "generic-tiff"}.get(series.kind, f"tiff-{series.kind}")
    if series.kind == "svs":
        vendor = "aperio"
        description = base_page.description or ""
        mpp = mpp_y = aperio_field(description, "MPP")  # Aperio states one MPP
        source = "vendor" if mpp is not None else "missing"
        objective = aperio_field(description, "AppMag")
    dims = tuple((lv.width, lv.height) for lv in levels)
    downsamples = tuple((base.width / lv.width + base.height / lv.height) / 2.0 for lv in levels)
    tiles = tuple((lv.seg_w, lv.seg_h) if lv.is_tiled else (0, 0) for lv in levels)
    return SlideMeta(
        backend=backend,
        vendor=vendor,
        level_dimensions=dims,
        level_downsamples=downsamples,
        mpp=mpp,
        mpp_source=source,
        objective_power=objective,
        tile_sizes=tiles,
        note=join_notes(channels_note(series, base_page), non_square_note(mpp, mpp_y)),
    )
