"""Quality control at index time: per-tile columns that find artefacts before patching.

Columns (float32, one value per tile; NaN where a measure does not apply, which no rule flags):

- ``qc_focus``: sharpness relative to the slide's typical tissue (1.0 typical, lower is
  blurrier), from the stored size of the JPEG tiles the tile is read from (`focus`);
- ``qc_pen``: share of the tile covered by pen ink (blue, green, red as histolab defines
  them, and black);
- ``qc_fold``: share of the tile that is tissue lying on itself (twice as dense, same colour);
- ``qc_bubble``: share of the tile inside an air bubble (a dark grey closed rim);
- ``qc_background``: share of the tile that is glass (neither stained tissue nor ink).

All but focus come from the low-resolution picture the builder reads anyway (`LowResolution`),
brought to about `QC_UM_PER_PX` um per pixel, where nuclei blur into tissue but strokes, folds
and bubbles stay several pixels wide; focus from the file's layout. Nothing of level 0 is
decoded. On a fluorescence slide pen, fold and bubble are NaN (ink and bubbles do not show in
dark field; a fold glows rather than darkens).

Rules turn columns into flags: ``pen``, ``fold``, ``bubble`` flag a share at or above their
threshold, ``blur`` a focus below its threshold (`RULES`; thresholds can be set per build or
per query). `qc_filter` gives the ``where=`` of `SlideIndex.open` that leaves flagged tiles out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from PIL import Image

from wsi_loader.config import close_key
from wsi_loader.errors import ConfigError
from wsi_loader.index._focus import Sharpness, relative_focus
from wsi_loader.index._lowres import FloatArray, LowResolution, TileBoxes, box_means
from wsi_loader.index._qc_pixels import (
    bubbles,
    folded,
    inked_folds,
    large_parts,
    pen_inks,
    tissue_layers,
)
from wsi_loader.index._tissue import BoolArray, PixelRule, tile_fractions
from wsi_loader.slides._base import RGBArray

QC_COLUMNS: dict[str, np.dtype[Any]] = {
    name: np.dtype(np.float32)
    for name in ("qc_focus", "qc_pen", "qc_fold", "qc_bubble", "qc_background")
}
QC_UM_PER_PX = 8.0  # the QC picture's resolution (HistoQC works at 1.25x, ~8 um/px)
MIN_TILE_PX = 4  # ...unless a tile would then be fewer pixels wide than this
NEIGHBOURHOOD_UM = 1000.0  # "the tissue around" a pixel, for folds and bubble rims
MIN_PEN_UM = 100.0  # ink areas smaller than this square are no strokes
MIN_FOLD_UM = 150.0  # folds smaller than this square are no folds (specks, nuclei clusters)
FOLD_REACH_UM = 1000.0  # a fold over pale tissue has it within this on both sides
MIN_BUBBLE_UM = 200.0  # the inside of a bubble is at least this square
BLUE_STAIN_SHARE = 0.5  # blue over more of the coloured area than this: the stain, not ink


@dataclass(frozen=True)
class Rule:
    """A flag from one column: ``column`` below (``below``) or at/above the threshold."""

    column: str
    threshold: float
    below: bool
    what: str

    def flags(self, values: npt.NDArray[np.floating], threshold: float | None = None) -> BoolArray:
        limit = self.threshold if threshold is None else threshold
        with np.errstate(invalid="ignore"):  # NaN compares False: never flagged
            flagged: BoolArray = values < limit if self.below else values >= limit
        return flagged


# Thresholds chosen on the synthetic validation slides (docs/journeys/qc.md): each sits
# between what clean tissue and the artefact measure there, with room on both sides.
RULES: dict[str, Rule] = {
    "pen": Rule("qc_pen", 0.1, False, "pen ink covers at least this share of the tile"),
    "blur": Rule("qc_focus", 0.5, True, "sharpness below this share of the slide's typical"),
    "fold": Rule("qc_fold", 0.2, False, "folded tissue covers at least this share"),
    "bubble": Rule("qc_bubble", 0.25, False, "an air bubble covers at least this share"),
}


def check_rule(name: str) -> Rule:
    """The rule called ``name``; a `ConfigError` (a ``ValueError``) naming the close rule."""
    if name not in RULES:
        raise ConfigError(
            f"no QC rule {name!r}{close_key(name, RULES)}; the rules are {', '.join(RULES)}",
            key=name,
        )
    return RULES[name]


def thresholds(
    overrides: Mapping[str, float] | None = None, base: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Every rule's threshold: ``base`` (the defaults when None), with ``overrides`` (rule
    name -> value)."""
    chosen = {name: rule.threshold for name, rule in RULES.items()} | dict(base or {})
    for name, value in (overrides or {}).items():
        check_rule(name)
        chosen[name] = float(value)
    return chosen


def built_thresholds(params: Mapping[str, Any]) -> dict[str, float]:
    """The thresholds an index was built with (its ``qc_thresholds`` parameter over the
    defaults); entries that are not a rule's number are ignored (an older or edited index)."""
    given = params.get("qc_thresholds") or {}
    if not isinstance(given, Mapping):
        return thresholds()
    return thresholds(
        {k: float(v) for k, v in given.items() if k in RULES and isinstance(v, int | float)}
    )


class BuiltIndex(Protocol):
    """What `flags` reads of a `SlideIndex` (kept structural: table.py imports this module)."""

    @property
    def columns(self) -> Mapping[str, npt.NDArray[Any]]: ...

    @property
    def params(self) -> dict[str, Any]: ...


Columns = Mapping[str, npt.NDArray[Any]]


def flags(
    source: Columns | BuiltIndex,
    rules: Iterable[str] | None = None,
    limits: Mapping[str, float] | None = None,
) -> dict[str, BoolArray]:
    """Per rule (all by default), which rows it flags, at ``limits`` over the thresholds of
    ``source``: an index's own (those it was built with, which ``info`` counts at), or, for
    bare columns (``index.columns``), the defaults. An index built without QC flags nothing
    (and has no such columns)."""
    if isinstance(source, Mapping):
        columns, chosen = source, thresholds(limits)
    else:
        columns, chosen = source.columns, thresholds(limits, built_thresholds(source.params))
    out = {}
    for name in RULES if rules is None else rules:
        rule = check_rule(name)
        values = columns.get(rule.column)
        if values is None:
            raise ValueError(
                f"the index has no {rule.column} column: build it with quality control on "
                "(qc: all, the default; not --qc none)"
            )
        out[name] = rule.flags(np.asarray(values), chosen[name])
    return out


@dataclass(frozen=True)
class QcFilter:
    """`qc_filter`'s ``where=``: keeps the rows none of ``rules`` flags at ``limits`` over
    the thresholds of what it is given (`flags`): `SlideIndex.open` gives it the index, so
    it drops what ``info`` counts as flagged; called on bare columns, the defaults."""

    rules: tuple[str, ...]
    limits: Mapping[str, float]

    def __call__(self, source: Columns | BuiltIndex) -> BoolArray:
        flagged = flags(source, self.rules, self.limits)
        columns = source if isinstance(source, Mapping) else source.columns
        bad = np.zeros(len(columns["slide_id"]), dtype=bool)
        for mask in flagged.values():
            bad |= mask
        return ~bad


def qc_filter(*rules: str, **limits: float) -> QcFilter:
    """A ``where=`` for `SlideIndex.open` / `SlideIndex.view` keeping the tiles none of
    ``rules`` (all when none are named) flags, at the index's own thresholds (those it was
    built with) or ``limits`` (``pen=0.05``...).

    ``SlideIndex.open("idx/", where=qc_filter("pen", "blur", blur=0.4))``"""
    chosen = tuple(rules) or tuple(RULES)
    thresholds({**dict.fromkeys(chosen, 0.0), **limits})  # names checked now, not at use
    return QcFilter(chosen, dict(limits))


@dataclass(frozen=True)
class QcResult:
    """The QC columns of every grid tile of a slide, and the slide's summary; ``areas``:
    the pixels of the QC picture each artefact covers (to draw them)."""

    columns: dict[str, FloatArray]
    summary: dict[str, Any]
    areas: Mapping[str, BoolArray] = field(default_factory=dict)


def measure(
    low: LowResolution,
    rule: PixelRule,
    tiles: TileBoxes,
    mpp: float | None,
    sharpness: Sharpness | None,
    tissue_mask: BoolArray | None = None,
) -> QcResult:
    """The QC columns of ``tiles`` from the slide's low-resolution picture (``rule``: which
    of its pixels are stained tissue) and the raw ``sharpness`` of each tile (None: no focus
    measure, NaN). ``tissue_mask`` (any scale): the slide's tissue, the pixels its tissue
    column counts; what it does not cover (and no ink or bubble does) is glass, so a tile
    is never mostly tissue and mostly glass at once (None: the stained pixels of ``rule``)."""
    picture, um_per_px = _qc_picture(low, tiles.footprint, mpp)
    h, w = picture.shape[:2]
    sx, sy = w / low.l0_size[0], h / low.l0_size[1]
    window = _neighbourhood(um_per_px, max(h, w))

    def shares(*masks: BoolArray) -> list[FloatArray]:
        return list(box_means(np.stack(masks), sx, sy, tiles))

    # the artefact rules read the saturated tissue alone (`PixelRule.pale` left out): with
    # pale tissue as the folds' reference, every dense area beside it is "twice as dense"
    # (a haematoxylin-rich core beside pale stroma, dense pink beside loose pink tissue)
    stained = replace(rule, pale=None).stained(picture)
    covered = stained if tissue_mask is None else _resized(tissue_mask, (w, h))
    nothing = np.zeros((h, w), dtype=bool)
    nan = np.full(len(tiles), np.nan, dtype=np.float32)
    blue_stain = False
    if rule.detector == "brightfield":
        blue, ink = pen_inks(picture)
        coloured = int((stained | blue | ink).sum())
        # "blue ink" over most of what is coloured is the slide's stain (Giemsa, methylene
        # blue): the pen rule never flags a whole slide's tissue
        blue_stain = coloured > 0 and int(blue.sum()) > BLUE_STAIN_SHARE * coloured
        if not blue_stain:
            ink |= blue
        saturated, whole = stained.copy(), rule.stained(picture)
        stained &= ~ink
        # a stroke is an area: lone ink-coloured pixels are specks or clumps of nuclei
        ink = large_parts(ink, _pixels(MIN_PEN_UM, um_per_px, w))
        # ...not of the tissue's own hue: a dense core lying on itself is a fold, not ink
        layers = tissue_layers(picture, ink, blue, stained, whole, window)
        ink &= ~layers
        stained |= layers & saturated
        bubble = bubbles(picture, ink, stained, window, _pixels(MIN_BUBBLE_UM, um_per_px, w))
        fold = folded(
            picture,
            stained & ~bubble,
            ink,
            window,
            _pixels(MIN_FOLD_UM, um_per_px, w),
            tissue=whole & ~ink & ~bubble,
            reach=_width(FOLD_REACH_UM, um_per_px, w),
        )
        # a stroke going on over tissue adds its density there: pen, not a fold
        inked = inked_folds(picture, fold, ink, stained & ~bubble, window)
        ink |= inked
        fold &= ~inked
        stained &= ~inked
        glass = ~(covered | stained) & ~ink & ~bubble
        tissue = covered & ~ink & ~bubble
        pen, fold_share, bubble_share, background, tissue_share = shares(
            ink, fold, bubble, glass, tissue
        )
        columns = {"qc_pen": pen, "qc_fold": fold_share, "qc_bubble": bubble_share}
        areas = {"pen": ink, "fold": fold, "bubble": bubble}
    else:
        columns = {"qc_pen": nan, "qc_fold": nan, "qc_bubble": nan.copy()}
        glass, tissue, areas = ~(covered | stained), covered, {}
        background, tissue_share = shares(glass, tissue)
    if tissue_mask is not None:
        # the glass share over the tissue column's boxes, at the mask's resolution: the two
        # shares are of disjoint pixels of the same boxes, so they add up to at most 1
        shape = tissue_mask.shape[::-1]
        marked = _resized(areas.get("pen", nothing) | areas.get("bubble", nothing), shape)
        background = tile_fractions(
            ~tissue_mask & ~marked, low.l0_size, tiles.l0_x, tiles.l0_y, tiles.footprint
        )
    columns["qc_background"] = background
    summary: dict[str, Any] = {
        "picture": f"{w}x{h} px" + (f" at {um_per_px:.3g} um/px" if um_per_px is not None else ""),
        "focus_source": None,
        "focus_reference": None,
    }
    if blue_stain:
        summary["blue_stain"] = True
    if sharpness is not None:
        focus = relative_focus(sharpness.raw, tissue_share)
        columns["qc_focus"] = focus.focus
        summary["focus_source"] = sharpness.source
        summary["focus_reference"] = None if math.isnan(focus.reference) else focus.reference
    else:
        columns["qc_focus"] = nan.copy()
    stained_area = float((stained | ~glass).sum())
    summary["area_shares"] = {  # of everything that is not glass in the picture
        name: round(float(mask.sum()) / stained_area, 5) if stained_area else 0.0
        for name, mask in areas.items()
    }
    ordered = {name: columns[name].astype(np.float32) for name in QC_COLUMNS}
    return QcResult(ordered, summary, areas)


def _resized(mask: BoolArray, size: tuple[int, int]) -> BoolArray:
    """A mask at another size (width, height): the majority of each pixel's area."""
    if mask.shape[::-1] == size:
        return mask
    grey = Image.fromarray(mask.astype(np.uint8) * 255).resize(
        size, Image.Resampling.BOX if size[0] < mask.shape[1] else Image.Resampling.NEAREST
    )
    out: BoolArray = np.asarray(grey) >= 128
    return out


def _qc_picture(
    low: LowResolution, footprint: float, mpp: float | None
) -> tuple[RGBArray, float | None]:
    """The low-resolution picture shrunk (whole-pixel box filter) to about `QC_UM_PER_PX`
    (or, without an MPP, to 16 pixels a tile), keeping tiles at least `MIN_TILE_PX` wide;
    and its microns per pixel (None without an MPP)."""
    image = low.image
    sx = low.scale[0]
    tile_px = footprint * sx
    # without a scale: tiles of 16 pixels (what 8 um/px makes of 0.5 um/px tiles of 256)
    wanted = QC_UM_PER_PX / (mpp / sx) if mpp is not None and mpp > 0 else tile_px / 16
    factor = max(1, min(math.floor(wanted), math.floor(tile_px / MIN_TILE_PX)))
    if factor > 1:
        image = np.asarray(Image.fromarray(np.ascontiguousarray(image)).reduce(factor))
    um_per_px = (mpp / (image.shape[1] / low.l0_size[0])) if mpp else None
    return image, um_per_px


def _pixels(side_um: float, um_per_px: float | None, width: int) -> int:
    """The area in picture pixels of a square ``side_um`` wide (without an MPP: of a square
    1/100 of the picture's width)."""
    side = side_um / um_per_px if um_per_px else width / 100
    return max(4, round(side * side))


def _width(um: float, um_per_px: float | None, width: int) -> float:
    """``um`` in picture pixels (without an MPP: as `_pixels` reads `MIN_FOLD_UM`, 1/100 of
    the picture's width)."""
    return um / um_per_px if um_per_px else width / 100 * um / MIN_FOLD_UM


def _neighbourhood(um_per_px: float | None, longest: int) -> int:
    """`NEIGHBOURHOOD_UM` in picture pixels (without an MPP, a twelfth of the picture)."""
    px = NEIGHBOURHOOD_UM / um_per_px if um_per_px else longest / 12
    return int(min(64, max(6, round(px))))


def counts(
    columns: Mapping[str, npt.NDArray[Any]],
    starts: npt.NDArray[np.int64],
    limits: Mapping[str, float] | None = None,
) -> list[dict[str, int]] | None:
    """Per slide (rows ``starts[s]:starts[s + 1]``), how many tiles each rule flags and how
    many any rule does; None for an index without QC columns."""
    if not all(rule.column in columns for rule in RULES.values()):
        return None
    flagged = flags(columns, None, limits)
    any_rule = np.zeros(len(columns["slide_id"]), dtype=bool)
    for mask in flagged.values():
        any_rule |= mask
    per_slide = []
    for sid in range(len(starts) - 1):
        rows = slice(int(starts[sid]), int(starts[sid + 1]))
        entry = {name: int(mask[rows].sum()) for name, mask in flagged.items()}
        entry["any"] = int(any_rule[rows].sum())
        per_slide.append(entry)
    return per_slide


def qc_totals(
    per_slide: list[dict[str, int]],
    limits: Mapping[str, float],
    records: Iterable[Any],
    split: str | None = None,
) -> dict[str, Any]:
    """The index-wide QC figures `SlideIndex.summary` reports: the thresholds counted at,
    tiles each rule flags, and tiles the build left out (``qc_exclude``), over the slides
    (of ``split``)."""
    flagged: dict[str, int] = dict.fromkeys([*RULES, "any"], 0)
    excluded: dict[str, int] = {}
    for entry, record in zip(per_slide, records, strict=True):
        if split is not None and record.split != split:
            continue
        for name in flagged:
            flagged[name] += entry[name]
        for name, n in excluded_counts(record.qc).items():
            excluded[name] = excluded.get(name, 0) + n
    return {"thresholds": dict(limits), "flagged": flagged, "excluded": excluded}


def excluded_counts(summary: Any) -> dict[str, int]:
    """The per-rule counts of tiles ``qc_exclude`` left out, from a slide's ``qc`` summary
    (as read back from slides.json: anything else than rule names and counts is ignored)."""
    excluded = summary.get("excluded") if isinstance(summary, Mapping) else None
    if not isinstance(excluded, Mapping):
        return {}
    return {
        str(name): int(n)
        for name, n in excluded.items()
        if (name in RULES or name == "any") and isinstance(n, int) and not isinstance(n, bool)
    }


def slide_summary(summary: Any) -> dict[str, Any] | None:
    """The slide-level QC figures of a slide's ``qc`` summary, as read back from slides.json:
    the picture QC worked on, where focus came from and the slide's typical tissue sharpness
    (``focus_reference``), and the share of the non-glass area each artefact covers
    (``area_shares``); entries of another shape are left out, None without a summary."""
    if not isinstance(summary, Mapping):
        return None
    found: dict[str, Any] = {}
    for key in ("picture", "focus_source"):
        if isinstance(summary.get(key), str):
            found[key] = summary[key]
    reference = summary.get("focus_reference")
    if isinstance(reference, int | float) and not isinstance(reference, bool):
        found["focus_reference"] = float(reference)
    shares = summary.get("area_shares")
    if isinstance(shares, Mapping):
        found["area_shares"] = {
            str(name): float(v)
            for name, v in shares.items()
            if name in RULES and isinstance(v, int | float) and not isinstance(v, bool)
        }
    return found
