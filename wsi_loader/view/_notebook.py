"""Look at what the index picked and what failed: overviews and mosaics (`_summary` has the
table).

Everything renders to a PIL image (PNG) with PIL's drawing only; objects show themselves in
Jupyter through ``_repr_png_`` / ``_repr_html_`` without importing anything from Jupyter.
Tiles for mosaics are read through the dataset's `TileReader` (same backends, same failure
policy), thumbnails from the lowest pyramid level (the same image the tissue mask used).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageDraw

from wsi_loader.dataset._reading import TileReader
from wsi_loader.errors import AnnotationError
from wsi_loader.index._lookup import resolve_slide
from wsi_loader.index._qc import QC_COLUMNS, built_thresholds
from wsi_loader.index._qc import flags as qc_flags
from wsi_loader.index._table import SlideIndex
from wsi_loader.index.annotations import read_regions
from wsi_loader.predict._outputs import LABEL_PALETTE
from wsi_loader.predict._pictures import (
    Renders,
    hatch,
    load_font,
    measured_mpp,
    scale_bar,
    slide_thumbnail,
)
from wsi_loader.stain._build import as_stain

ColorBy = Literal["tissue", "label", "status", "annotation", "qc"]
COLOR_BY: tuple[str, ...] = ("tissue", "label", "status", "annotation", "qc")
# colour of each quality-control rule (a tile several rules flag shows the first listed)
QC_COLOURS = {
    "pen": (31, 119, 180),
    "fold": (214, 39, 40),
    "bubble": (23, 190, 207),
    "blur": (255, 127, 14),
}
QC_CLEAN = (46, 160, 67)
STATUS_COLOURS = {"ok": (46, 160, 67), "substituted": (245, 159, 0), "quarantined": (220, 38, 38)}
UNLABELLED = (120, 120, 120)
UNREADABLE = (160, 0, 160)  # thumbnail areas whose pixels could not be read
# viridis at 0, 0.25, 0.5, 0.75, 1: tissue fraction colour ramp
_RAMP = np.array(
    [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)], dtype=np.float32
)


def tissue_colour(fraction: float) -> tuple[int, int, int]:
    pos = min(max(fraction, 0.0), 1.0) * (len(_RAMP) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(_RAMP) - 1)
    rgb = _RAMP[lo] + (_RAMP[hi] - _RAMP[lo]) * (pos - lo)
    return int(rgb[0]), int(rgb[1]), int(rgb[2])


@dataclass(frozen=True)
class Cell:
    """One drawn grid cell: thumbnail pixel box and what it shows."""

    box: tuple[float, float, float, float]
    l0_x: int
    l0_y: int
    status: str
    tissue: float
    label: int = -1  # the tile's label id (index.label_names)
    annotation: int = -1  # the class covering most of the tile (index.classes), -1: none
    coverage: float = 0.0  # the share of the tile that class covers
    qc: str = ""  # the first QC rule that flags the tile (QC_COLOURS order), "" for none


class SlideOverview(Renders):
    """The slide thumbnail with the tile grid drawn over it, a legend and a scale bar.

    ``color_by``: ``tissue`` (fraction, colour ramp), ``label`` (one colour per tile label:
    the slide's, or the annotated class), ``status`` (ok / quarantined / substituted, from
    the quarantine), ``annotation`` (the class covering most of each tile, stronger the more
    it covers) or ``qc`` (the quality-control rule that flags each tile, at the thresholds the
    index was built with: pen, fold, bubble, blur; none in green). The outlines of the
    slide's annotation regions are drawn in their class's
    colour whenever the index was built with annotations. ``cells`` lists what was drawn, in
    thumbnail pixels, for checks; ``outlines`` the drawn rings (class, thumbnail points).
    """

    def __init__(
        self,
        index: SlideIndex,
        slide: str | int | None = None,
        color_by: str = "tissue",
        max_size: int = 1024,
    ) -> None:
        if color_by not in COLOR_BY:
            raise ValueError(f"color_by must be one of {COLOR_BY}, got {color_by!r}")
        self.index, self.color_by = index, color_by
        self.slide_id = resolve_slide(index, slide)
        record = index.slides[self.slide_id]
        if record.status != "ok":
            raise ValueError(f"slide {record.path} was not indexed: {record.error}")
        thumb, self.unreadable, self.l0_size = slide_thumbnail(
            index.slide_path(self.slide_id), max_size
        )
        self.scale = thumb.shape[1] / self.l0_size[0]
        if color_by == "annotation" and not index.classes:
            raise ValueError(
                "color_by='annotation' needs an index built with annotations (--annotations)"
            )
        if color_by == "qc" and not all(c in index.columns for c in QC_COLUMNS):
            raise ValueError("color_by='qc' needs an index built with quality control (qc: all)")
        self.outlines = self._outlines()
        self.cells = self._cells()
        self.image = self._draw(Image.fromarray(thumb))

    def __repr__(self) -> str:
        width, height = self.image.size
        return (
            f"SlideOverview({self.index.slides[self.slide_id].path!r}, "
            f"color_by={self.color_by!r}, {width}x{height} px, {len(self.cells)} tiles)"
        )

    def _cells(self) -> list[Cell]:
        index, record = self.index, self.index.slides[self.slide_id]
        cols = index.columns
        starts = index.slide_starts()
        rows = np.arange(starts[self.slide_id], starts[self.slide_id + 1])
        footprint = (record.read_size or 0) * (record.read_downsample or 1.0)
        status: dict[tuple[int, int], str] = {}
        for entry in index.quarantine.tile_records():  # slide records have no position
            if entry["path"] == record.path and entry.get("level") in (None, record.read_level):
                key = (int(entry["x"]), int(entry["y"]))
                status[key] = (
                    "substituted" if entry.get("policy") == "substitute" else "quarantined"
                )
        cells = []
        seen = set()
        labels = index.tile_labels(rows).tolist()
        coverage = index.coverage
        first_flag = self._first_flags(rows)
        for i, row in enumerate(rows.tolist()):
            x, y = int(cols["l0_x"][row]), int(cols["l0_y"][row])
            seen.add((x, y))
            cell = self._cell(x, y, footprint, status.get((x, y), "ok"), float(cols["tissue"][row]))
            top, share = -1, 0.0
            if coverage is not None and coverage.shape[1]:
                top = int(np.argmax(coverage[row]))
                share = float(coverage[row, top])
            cells.append(
                Cell(
                    cell.box,
                    x,
                    y,
                    cell.status,
                    cell.tissue,
                    labels[i],
                    top if share > 0 else -1,
                    share,
                    first_flag[i],
                )
            )
        for (x, y), state in status.items():  # quarantined tiles excluded from this index
            if (x, y) not in seen:
                cells.append(self._cell(x, y, footprint, state, float("nan")))
        return cells

    def _first_flags(self, rows: np.ndarray) -> list[str]:
        """Per row, the first QC rule (`QC_COLOURS` order) that flags it, "" for none."""
        if not all(c in self.index.columns for c in QC_COLUMNS):
            return [""] * len(rows)
        picked = {name: column[rows] for name, column in self.index.columns.items()}
        flagged = qc_flags(picked, list(QC_COLOURS), built_thresholds(self.index.params))
        first = np.full(len(rows), "", dtype=object)
        for name in reversed(QC_COLOURS):  # the first listed wins
            first[flagged[name]] = name
        return [str(v) for v in first]

    def _cell(self, x: int, y: int, footprint: float, status: str, tissue: float) -> Cell:
        s = self.scale
        return Cell((x * s, y * s, (x + footprint) * s, (y + footprint) * s), x, y, status, tissue)

    def _outlines(self) -> list[tuple[str, list[tuple[float, float]]]]:
        """The rings of the slide's annotation regions, in thumbnail pixels."""
        record = self.index.slides[self.slide_id]
        if not record.annotations:
            return []
        try:
            objects = self.index.params.get("annotation_objects") or ()  # as indexed
            regions = read_regions(record.annotations, record.width, record.height, objects)
        except (AnnotationError, OSError) as exc:  # the files changed since indexing
            self.outline_error = str(exc)
            return []
        rings = []
        for name, geometry in regions.classes.items():
            for polygon in getattr(geometry, "geoms", [geometry]):
                if polygon.geom_type != "Polygon":
                    continue
                for ring in [polygon.exterior, *polygon.interiors]:
                    points = [(x * self.scale, y * self.scale) for x, y in ring.coords]
                    rings.append((name, points))
        return rings

    def _class_colour(self, name: str) -> tuple[int, int, int]:
        classes = list(self.index.classes)
        i = classes.index(name) if name in classes else len(classes)
        return LABEL_PALETTE[i % len(LABEL_PALETTE)]

    def _label_colour(self, label: int) -> tuple[int, int, int]:
        return LABEL_PALETTE[label % len(LABEL_PALETTE)] if label >= 0 else UNLABELLED

    def _colour(self, cell: Cell) -> tuple[int, int, int]:
        if self.color_by == "status":
            return STATUS_COLOURS[cell.status]
        if self.color_by == "label":
            return self._label_colour(cell.label)
        if self.color_by == "annotation":
            if cell.annotation < 0:
                return UNLABELLED
            return self._class_colour(self.index.classes[cell.annotation])
        if self.color_by == "qc":
            return QC_COLOURS[cell.qc] if cell.qc else QC_CLEAN
        return tissue_colour(0.0 if math.isnan(cell.tissue) else cell.tissue)

    def _draw(self, thumb: Image.Image) -> Image.Image:
        base = thumb.convert("RGBA")
        overlay = Image.new("RGBA", base.size, (0, 0, 0, 0))
        draw = ImageDraw.Draw(overlay)
        for box in self.unreadable:  # hatched: nothing there could be read
            hatch(draw, box, UNREADABLE)
        for cell in self.cells:
            colour = self._colour(cell)
            fill_alpha = 150 if cell.status != "ok" else 70
            if self.color_by == "annotation" and cell.status == "ok":
                fill_alpha = int(20 + 130 * cell.coverage)
            if self.color_by == "qc" and cell.status == "ok":
                fill_alpha = 140 if cell.qc else 25
            draw.rectangle(cell.box, fill=(*colour, fill_alpha), outline=(*colour, 230))
            if cell.status != "ok":  # failures stay visible whatever the colouring
                x0, y0, x1, y1 = cell.box
                red = (*STATUS_COLOURS[cell.status], 255)
                draw.line((x0, y0, x1, y1), fill=red, width=2)
                draw.line((x0, y1, x1, y0), fill=red, width=2)
        for name, points in self.outlines:
            draw.line(points, fill=(*self._class_colour(name), 255), width=2)
        composed = Image.alpha_composite(base, overlay).convert("RGB")
        return self._frame(composed)

    def _legend_entries(self) -> list[tuple[tuple[int, int, int], str]]:
        extra = [(UNREADABLE, "unreadable thumbnail")] if self.unreadable else []
        return self._colour_entries() + extra

    def _colour_entries(self) -> list[tuple[tuple[int, int, int], str]]:
        if self.color_by == "status":
            counts = Counter(c.status for c in self.cells)
            return [(STATUS_COLOURS[s], f"{s} ({counts.get(s, 0)})") for s in STATUS_COLOURS]
        if self.color_by == "label":
            per_label = Counter(c.label for c in self.cells)
            names = self.index.label_names
            return [
                (self._label_colour(i), f"{names[i] if i >= 0 else 'unlabelled'} ({n})")
                for i, n in sorted(per_label.items())
            ]
        if self.color_by == "annotation":
            per_class = Counter(c.annotation for c in self.cells)
            return [
                (
                    self._class_colour(self.index.classes[i]) if i >= 0 else UNLABELLED,
                    f"{self.index.classes[i] if i >= 0 else 'no annotation'} ({n})",
                )
                for i, n in sorted(per_class.items())
            ]
        if self.color_by == "qc":
            per_rule = Counter(c.qc for c in self.cells if c.status == "ok")
            return [(QC_CLEAN, f"no flag ({per_rule.get('', 0)})")] + [
                (colour, f"{name} ({per_rule.get(name, 0)})") for name, colour in QC_COLOURS.items()
            ]
        drawn = sorted({name for name, _ in self.outlines})
        outlines = [(self._class_colour(n), f"outline: {n}") for n in drawn]
        return [(tissue_colour(f), f"tissue {f:.2f}") for f in (0.25, 0.5, 0.75, 1.0)] + outlines

    def _frame(self, picture: Image.Image) -> Image.Image:
        """Add a title above and the legend and scale bar below the picture."""
        record = self.index.slides[self.slide_id]
        font, small = load_font(16), load_font(13)
        width = max(picture.width, 420)
        canvas = Image.new("RGB", (width + 20, picture.height + 110), "white")
        draw = ImageDraw.Draw(canvas)
        mpp = f"{record.tile_mpp:.3g} um/px tiles" if record.tile_mpp else "no MPP"
        draw.text(
            (10, 6),
            f"{os.path.basename(record.path)}  |  {record.tiles} tiles, "
            f"{record.read_size} px at level {record.read_level}, {mpp}",
            fill="black",
            font=font,
        )
        self.origin = (10, 32)
        canvas.paste(picture, self.origin)
        y = picture.height + 42
        x = 10
        for colour, text in self._legend_entries():
            draw.rectangle((x, y, x + 14, y + 14), fill=colour, outline="black")
            draw.text((x + 20, y), text, fill="black", font=small)
            x += 30 + int(draw.textlength(text, font=small))
        if measured_mpp(record.mpp, record.mpp_source):
            scale_bar(draw, (10, y + 36), picture.width, record.mpp / self.scale, small)
        return canvas


class Mosaic(Renders):
    """``n`` tiles from an index or a dataset in a grid with captions, read by the dataset's
    reader (a plain index gets a reader that does not write the quarantine).

    Filter by ``slide``, ``label`` (name), ``status`` (``ok`` / ``quarantined``) or ``qc`` (a
    quality-control rule: tiles it flags, at the index's thresholds; ``any``: any rule).
    Tiles that fail to read show the fill colour with a red border. ``stain`` (transforms of
    `wsi_loader.stain`): each tile is shown as read, then transformed, side by side.
    """

    def __init__(
        self,
        data: Any,
        n: int = 16,
        *,
        slide: str | int | None = None,
        label: str | None = None,
        status: str | None = None,
        qc: str | None = None,
        seed: int = 0,
        tile_px: int = 160,
        columns: int | None = None,
        stain: Any = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if status not in (None, "ok", "quarantined"):
            raise ValueError(f"status must be 'ok' or 'quarantined', got {status!r}")
        # an index, or a dataset (TileDataset / SlideBagDataset): then its reader and policy
        reader: TileReader | None = getattr(data, "reader", None)
        index = data if isinstance(data, SlideIndex) else getattr(data, "index", None)
        if not isinstance(index, SlideIndex):
            raise TypeError(f"expected a SlideIndex or a dataset, got {type(data).__name__}")
        self.index = index
        candidates = self._candidates(slide, label, status, qc)
        if not len(candidates):
            raise ValueError("no tile matches the filters")
        rng = np.random.default_rng(seed)
        self.rows = np.sort(rng.choice(candidates, size=min(n, len(candidates)), replace=False))
        if reader is None:
            reader = TileReader(index, record_failures=False)
        result = reader.read(self.rows)
        self.ok = result.ok
        pixels, self.after = result.pixels, np.zeros(len(self.rows), dtype=bool)
        given = as_stain(stain)
        steps = None if given is None else given.bind(index)
        if steps is not None:  # each tile twice: as read, then stained
            stained = pixels.copy()
            slide_ids = np.asarray(index.columns["slide_id"][self.rows], dtype=np.int64)
            steps.apply_numpy(stained, slide_ids, self.rows, 0, result.ok)
            pixels = np.stack([pixels, stained], axis=1).reshape(-1, *pixels.shape[1:])
            self.rows, self.ok = np.repeat(self.rows, 2), np.repeat(self.ok, 2)
            self.after = np.tile([False, True], len(self.after))
        self.stain_name = "" if steps is None else _stain_name(steps)
        self.columns = columns or math.ceil(math.sqrt(len(self.rows)))
        if steps is not None and columns is None:
            self.columns += self.columns % 2  # pairs stay on one line
        self.image = self._draw(pixels, tile_px)

    def __repr__(self) -> str:
        failed = int((~self.ok).sum())
        return f"Mosaic({len(self.rows)} tiles, {failed} failed, {self.columns} columns)"

    def _candidates(
        self, slide: str | int | None, label: str | None, status: str | None, qc: str | None
    ) -> np.ndarray:
        cols = self.index.columns
        keep = np.ones(len(self.index), dtype=bool)
        if slide is not None:
            keep &= cols["slide_id"] == resolve_slide(self.index, slide)
        if label is not None:
            if label not in self.index.label_names:
                raise ValueError(f"no label {label!r}; labels: {list(self.index.label_names)}")
            lid = self.index.label_names.index(label)
            keep &= self.index.tile_labels() == lid
        if status is not None:
            bad = self.index.quarantined_mask()
            keep &= bad if status == "quarantined" else ~bad
        if qc is not None:
            flagged = qc_flags(
                cols, None if qc == "any" else [qc], built_thresholds(self.index.params)
            )
            keep &= np.logical_or.reduce(list(flagged.values()))
        return np.flatnonzero(keep)

    def _draw(self, pixels: np.ndarray, tile_px: int) -> Image.Image:
        cols = self.index.columns
        caption_h, pad = 34, 6
        n_rows = math.ceil(len(self.rows) / self.columns)
        canvas = Image.new(
            "RGB",
            (self.columns * (tile_px + pad) + pad, n_rows * (tile_px + caption_h + pad) + pad),
            "white",
        )
        draw = ImageDraw.Draw(canvas)
        font = load_font(11)
        for i, row in enumerate(self.rows.tolist()):
            r, c = divmod(i, self.columns)
            x = pad + c * (tile_px + pad)
            y = pad + r * (tile_px + caption_h + pad)
            canvas.paste(Image.fromarray(pixels[i]).resize((tile_px, tile_px)), (x, y))
            if not self.ok[i]:
                draw.rectangle(
                    (x, y, x + tile_px - 1, y + tile_px - 1), outline=(220, 38, 38), width=4
                )
            record = self.index.slides[int(cols["slide_id"][row])]
            mpp = f"{record.tile_mpp:.3g}um/px" if record.tile_mpp else "no MPP"
            name = os.path.splitext(os.path.basename(record.path))[0]
            where = f"({int(cols['l0_x'][row])},{int(cols['l0_y'][row])})"
            second = f"{where} {mpp}"
            if draw.textlength(second, font=font) > tile_px:
                second = where  # the MPP goes first: the position finds the tile again
            if self.after[i]:
                name, second = f"after: {self.stain_name}", f"{where}"
            for dy, text in ((2, name), (16, second)):
                draw.text((x, y + tile_px + dy), _fit(draw, text, font, tile_px), "black", font)
        return canvas


def _stain_name(steps: Any) -> str:
    """A caption for stain transforms: 'macenko', 'hed_jitter + reinhard'..."""
    names = [s.get("method", s["transform"]) for s in steps.spec()]
    return " + ".join(names)


def _fit(draw: ImageDraw.ImageDraw, text: str, font: Any, width: int) -> str:
    """``text``, cut short with '…' until it is at most ``width`` pixels wide."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…" if text else ""
