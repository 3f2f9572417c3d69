"""Heatmaps of tile outputs over the slide thumbnail: predict's ``heatmaps/<slide>.png``,
``inspect --predictions`` and MIL attention, drawn with `_pictures`' helpers (thumbnail from a
low pyramid level, scale bar, hatching of what could not be read).

Each thumbnail pixel shows the mean of the tiles covering its centre, so an overlapping grid
(``index --stride`` below the tile size) gives a smooth map; pixels no tile covers show the
slide. Values go through viridis (perceptually uniform) blended over the thumbnail, one panel
per class (or only the class asked for), with a colour bar; failed tiles are hatched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageDraw

from wsi_loader.errors import InputError
from wsi_loader.index._lookup import resolve_slide
from wsi_loader.index._table import SlideIndex
from wsi_loader.predict._outputs import TilePredictions, read_run, slide_files, slide_stems
from wsi_loader.predict._pictures import (
    Renders,
    hatch,
    load_font,
    measured_mpp,
    scale_bar,
    slide_thumbnail,
)

# viridis (matplotlib's), at 17 evenly spaced points, interpolated linearly in between
VIRIDIS = np.array(
    [
        (68, 1, 84),
        (72, 24, 106),
        (71, 45, 123),
        (66, 64, 134),
        (59, 82, 139),
        (51, 99, 141),
        (44, 114, 142),
        (38, 130, 142),
        (33, 145, 140),
        (31, 159, 136),
        (39, 173, 129),
        (61, 188, 116),
        (92, 200, 99),
        (129, 211, 77),
        (170, 220, 50),
        (213, 226, 26),
        (253, 231, 37),
    ],
    dtype=np.float32,
)
FAILED = (220, 38, 38)  # hatching of failed tiles
BLEND = 0.55  # weight of the colour over the thumbnail
MAX_PANELS = 12  # classes drawn side by side at most (more: name one with heatmap_class)


def colour_map(values: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Viridis colours (..., 3) of ``values`` in [0, 1] (clipped; NaN as 0)."""
    v = np.nan_to_num(np.clip(np.asarray(values, dtype=np.float32), 0, 1), nan=0.0)
    pos = v * (len(VIRIDIS) - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, len(VIRIDIS) - 1)
    frac = (pos - lo)[..., None]
    rgb = VIRIDIS[lo] + (VIRIDIS[hi] - VIRIDIS[lo]) * frac
    return np.rint(rgb).astype(np.uint8)


def tile_means(
    boxes: npt.ArrayLike, values: npt.ArrayLike, shape: tuple[int, int], scale: float
) -> npt.NDArray[np.float32]:
    """Per pixel of a (height, width) picture at ``scale`` picture pixels per level-0 pixel,
    the mean of ``values`` (N, C) over the tiles whose level-0 box (N, 4: minx, miny, width,
    height) covers the pixel's centre; NaN where none does. Two cumulative sums, whatever the
    overlap. A value that is not finite (NaN, Inf) is left out of the means of its class (the
    other tiles of its pixels still count), and a box that is not finite is left out: in a
    cumulative sum it would spoil every pixel right of and below it."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    values = np.asarray(values, dtype=np.float64).reshape(len(boxes), -1)
    keep = np.isfinite(boxes).all(axis=1)
    boxes, values = boxes[keep], values[keep]
    height, width = shape
    # pixel j's centre (j + 0.5) / scale lies in [x0, x1) when ceil(x0 * scale - 0.5) <= j <
    # ceil(x1 * scale - 0.5)
    c0 = np.clip(np.ceil(boxes[:, 0] * scale - 0.5), 0, width).astype(np.int64)
    c1 = np.clip(np.ceil((boxes[:, 0] + boxes[:, 2]) * scale - 0.5), 0, width).astype(np.int64)
    r0 = np.clip(np.ceil(boxes[:, 1] * scale - 0.5), 0, height).astype(np.int64)
    r1 = np.clip(np.ceil((boxes[:, 1] + boxes[:, 3]) * scale - 0.5), 0, height).astype(np.int64)
    channels = values.shape[1]
    sums = np.zeros((height + 1, width + 1, 2 * channels))
    finite = np.isfinite(values)
    # the values (non-finite ones as 0), then per class the count of the values summed
    weighted = np.concatenate([np.where(finite, values, 0.0), finite.astype(np.float64)], axis=1)
    for rows, cols, sign in ((r0, c0, 1), (r0, c1, -1), (r1, c0, -1), (r1, c1, 1)):
        np.add.at(sums, (rows, cols), sign * weighted)
    sums = sums.cumsum(axis=0).cumsum(axis=1)[:height, :width]
    count = np.rint(sums[..., channels:])  # exact integers, whatever the rounding of the sums
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(count > 0, sums[..., :channels] / np.maximum(count, 1), np.nan)
    return means.astype(np.float32)


class SlideHeatmap(Renders):
    """Tile values (``values``: N x C, one column per name in ``names``) over the thumbnail of
    the slide at ``path``; ``boxes``: the tiles' level-0 boxes (N x 4: minx, miny, width,
    height); ``failed``: boxes of tiles that failed (hatched). ``show``: the columns to draw
    (names; default all). ``mpp``: the slide's measured MPP for the scale bar (None: none).

    ``values`` (H x W x C, NaN where no tile) holds what each thumbnail pixel shows, before
    colouring, and ``scale`` thumbnail pixels per level-0 pixel, for checks and notebooks.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        boxes: npt.ArrayLike,
        values: npt.ArrayLike,
        names: Sequence[str],
        *,
        failed: npt.ArrayLike = (),
        show: Sequence[str] | None = None,
        mpp: float | None = None,
        title: str | None = None,
        label: str = "probability",
        max_size: int = 1024,
    ) -> None:
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        values = np.asarray(values, dtype=np.float32).reshape(len(boxes), len(names))
        show = list(show) if show else list(names)
        unknown = [n for n in show if n not in names]
        if unknown:
            raise ValueError(f"no class {unknown[0]!r} to draw; the classes are {list(names)}")
        if len(show) > MAX_PANELS:
            raise ValueError(
                f"{len(show)} classes are too many panels for one picture (at most "
                f"{MAX_PANELS}): name the class to draw (heatmap_class)"
            )
        columns = [list(names).index(n) for n in show]
        panel = max_size if len(show) == 1 else max(256, max_size // 2)
        thumb, unreadable, l0_size = slide_thumbnail(os.fspath(path), panel)
        self.scale = thumb.shape[1] / l0_size[0]
        self.values = tile_means(boxes, values[:, columns], thumb.shape[:2], self.scale)
        self.names = show
        failed_boxes = np.asarray(failed, dtype=np.float64).reshape(-1, 4)
        panels = [
            self._panel(thumb, self.values[..., i], failed_boxes, unreadable)
            for i in range(len(show))
        ]
        name = title or Path(os.fspath(path)).name
        self.image = self._frame(panels, name, label, mpp, len(boxes), len(failed_boxes))

    def _panel(
        self,
        thumb: npt.NDArray[np.uint8],
        values: npt.NDArray[np.float32],
        failed: npt.NDArray[np.float64],
        unreadable: list[tuple[int, int, int, int]],
    ) -> Image.Image:
        covered = ~np.isnan(values)
        picture = thumb.astype(np.float32)
        colours = colour_map(values).astype(np.float32)
        picture[covered] = (1 - BLEND) * picture[covered] + BLEND * colours[covered]
        image = Image.fromarray(np.rint(picture).astype(np.uint8)).convert("RGBA")
        overlay = Image.new("RGBA", image.size, (0, 0, 0, 0))
        draw = ImageDraw.Draw(overlay)
        for box in unreadable:
            hatch(draw, box, (160, 0, 160))
        s = self.scale
        for x, y, w, h in failed.tolist():
            hatch(draw, (x * s, y * s, (x + w) * s, (y + h) * s), FAILED, step=4)
        return Image.alpha_composite(image, overlay).convert("RGB")

    def _frame(
        self,
        panels: list[Image.Image],
        name: str,
        label: str,
        mpp: float | None,
        tiles: int,
        failed: int,
    ) -> Image.Image:
        """Panels in a grid (two across), each titled; a title above; the colour bar, the
        failed-tile key and the scale bar below."""
        font, small = load_font(16), load_font(13)
        across = 1 if len(panels) == 1 else 2
        down = math.ceil(len(panels) / across)
        pw, ph = panels[0].size
        width = max(across * (pw + 10) + 10, 440)
        canvas = Image.new("RGB", (width, 36 + down * (ph + 24) + 90), "white")
        draw = ImageDraw.Draw(canvas)
        draw.text((10, 8), f"{name}  |  {tiles} tiles, {failed} failed", fill="black", font=font)
        for i, (panel, column) in enumerate(zip(panels, self.names, strict=True)):
            x = 10 + (i % across) * (pw + 10)
            y = 36 + (i // across) * (ph + 24)
            draw.text((x, y), column, fill="black", font=small)
            canvas.paste(panel, (x, y + 18))
        y = 36 + down * (ph + 24) + 6
        bar = colour_map(np.linspace(0, 1, 200))[None].repeat(12, axis=0)
        canvas.paste(Image.fromarray(bar), (10, y))
        for value in (0.0, 0.5, 1.0):
            draw.text((10 + value * 190, y + 14), f"{value:g}", fill="black", font=small)
        draw.text((220, y - 1), label, fill="black", font=small)
        x = 230 + int(draw.textlength(label, font=small))
        if failed:
            hatch(draw, (x, y, x + 14, y + 14), FAILED, step=4)
            draw.text((x + 20, y - 1), f"failed tile ({failed})", fill="black", font=small)
        if mpp:
            scale_bar(draw, (10, y + 44), pw, mpp / self.scale, small)
        return canvas


def prediction_heatmap(
    index: SlideIndex,
    predictions: str | os.PathLike[str],
    slide: str | int | None = None,
    *,
    heatmap_class: str | None = None,
    max_size: int = 1024,
) -> SlideHeatmap:
    """The heatmap `predict` drew for one slide (``slide``: id, path or name; default the
    first slide with predictions), from a predictions folder and the index it ran on: for
    notebooks and ``inspect --predictions``."""
    run = read_run(predictions)
    by_path = run.get("slides")
    if not isinstance(by_path, dict) or not by_path:
        raise InputError("no slide has predictions in this folder", path=os.fspath(predictions))
    if slide is None:
        paths = [s.path for s in index.slides]
        slide = next((p for p in paths if p in by_path), None)
        if slide is None:
            raise InputError(
                "none of this index's slides has predictions here (another index?)",
                path=os.fspath(predictions),
            )
    sid = resolve_slide(index, slide)
    record = index.slides[sid]
    stem = slide_stems(run, predictions).get(record.path)
    if stem is None:
        raise InputError(f"no predictions for {record.path}", path=os.fspath(predictions))
    tiles = TilePredictions.read_csv(slide_files(Path(predictions), stem)["csv"])
    side = int(tiles.boxes[0, 2]) if len(tiles.boxes) else 0
    failures = run.get("failures")
    failed = [
        (f["x"], f["y"], side, side)
        for f in (failures if isinstance(failures, list) else [])
        if isinstance(f, dict) and f.get("slide") == record.path
    ]
    return SlideHeatmap(
        index.slide_path(sid),
        tiles.boxes,
        tiles.probabilities,
        tiles.classes,
        failed=failed,
        show=[heatmap_class] if heatmap_class else None,
        mpp=record.mpp if measured_mpp(record.mpp, record.mpp_source) else None,
        title=stem,
        max_size=max_size,
    )
