"""Artefacts painted onto synthetic slides, with masks known exactly: pen strokes along curves,
Gaussian-blurred (out-of-focus) regions, folded tissue, air bubbles.

They validate the index's quality control (`wsi_loader.index._qc`): a slide is written with
`SlideSpec(artefacts=...)`, indexed, and the QC columns compared with `truth_shares`, the
share of each tile every kind of artefact covers. Each artefact is drawn from level-0
geometry at every pyramid level, antialiased (drawn at 4x and averaged), so the levels agree
as a scanner's would. `qc_layout` places a standard set on a slide's tissue.

How each one looks (the physics, roughly):

- **pen**: marker ink on the coverslip, laid over whatever is below it (multiplied, so tissue
  under ink is darker), soft-edged; blue, green, black or red.
- **blur**: a region out of focus; the tissue there is a Gaussian blur (sigma in level-0
  pixels) of what it would be.
- **fold**: tissue lying on itself: two layers absorb twice (optical density doubles), so
  the strip is darker and more saturated; only where there is tissue.
- **bubble**: air under the coverslip: a dark grey rim where light refracts away, and a
  washed-out, slightly blurred inside.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageDraw
from scipy import ndimage

Point = tuple[float, float]
Ink = Literal["blue", "green", "black", "red"]
ArtefactKind = Literal["pen", "blur", "fold", "bubble"]
ARTEFACT_KINDS: tuple[ArtefactKind, ...] = ("pen", "blur", "fold", "bubble")

# what ink multiplies the pixels below it by (transmittance per channel, 0..1)
INK_TRANSMITTANCE: dict[str, tuple[float, float, float]] = {
    "blue": (0.16, 0.30, 0.72),
    "green": (0.18, 0.58, 0.40),
    "black": (0.14, 0.14, 0.16),
    "red": (0.85, 0.16, 0.20),
}
_SUPERSAMPLE = 4  # artefact outlines are drawn at 4x and averaged (antialiased)
_RIM_GREY = np.array([70.0, 70.0, 76.0], dtype=np.float32)


@dataclass(frozen=True)
class PenStroke:
    """Marker ink along a curve (level-0 points, joined smoothly), ``width`` level-0 px wide."""

    points: tuple[Point, ...]
    width: float
    ink: Ink = "blue"
    kind: ArtefactKind = "pen"


@dataclass(frozen=True)
class BlurredRegion:
    """An ellipse (level-0 centre and radii) out of focus: Gaussian blur of ``sigma`` level-0 px."""

    centre: Point
    radii: Point
    sigma: float
    kind: ArtefactKind = "blur"


@dataclass(frozen=True)
class Fold:
    """A strip of tissue folded onto itself: along a curve, ``width`` level-0 px wide."""

    points: tuple[Point, ...]
    width: float
    kind: ArtefactKind = "fold"


@dataclass(frozen=True)
class Bubble:
    """An air bubble: a circle of ``radius`` with a dark rim ``rim`` level-0 px wide."""

    centre: Point
    radius: float
    rim: float
    kind: ArtefactKind = "bubble"


Artefact = PenStroke | BlurredRegion | Fold | Bubble


def _bounds(artefact: Artefact) -> tuple[float, float, float, float]:
    """Level-0 box (x0, y0, x1, y1) the artefact's effect can reach."""
    if isinstance(artefact, PenStroke | Fold):
        xs = [p[0] for p in artefact.points]
        ys = [p[1] for p in artefact.points]
        half = artefact.width / 2 + 2
        return min(xs) - half, min(ys) - half, max(xs) + half, max(ys) + half
    if isinstance(artefact, BlurredRegion):
        (cx, cy), (rx, ry) = artefact.centre, artefact.radii
        return cx - rx, cy - ry, cx + rx, cy + ry
    cx, cy = artefact.centre
    r = artefact.radius
    return cx - r, cy - r, cx + r, cy + r


def touches(artefact: Artefact, l0_x: float, l0_y: float, l0_w: float, l0_h: float) -> bool:
    """Whether the artefact can change pixels of the level-0 box."""
    x0, y0, x1, y1 = _bounds(artefact)
    return x0 < l0_x + l0_w and x1 > l0_x and y0 < l0_y + l0_h and y1 > l0_y


def coverage(
    artefact: Artefact, l0_x: float, l0_y: float, ds: float, w: int, h: int, part: str = "all"
) -> npt.NDArray[np.float32]:
    """Share (0..1) of each pixel of a ``w`` x ``h`` window at downsample ``ds`` (top-left
    level-0 ``l0_x, l0_y``) the artefact covers. For a bubble, ``part`` picks the ``rim``,
    the ``inside`` or ``all`` of it."""
    s = _SUPERSAMPLE
    canvas = Image.new("L", (w * s, h * s), 0)
    draw = ImageDraw.Draw(canvas)

    def px(point: Point) -> Point:
        return ((point[0] - l0_x) / ds * s, (point[1] - l0_y) / ds * s)

    if isinstance(artefact, PenStroke | Fold):
        points = [px(p) for p in artefact.points]
        width = max(1, round(artefact.width / ds * s))
        draw.line(points, fill=255, width=width)
        for x, y in points:  # round joints and caps (PIL's joint="curve" is ~8x slower)
            draw.ellipse((x - width / 2, y - width / 2, x + width / 2, y + width / 2), fill=255)
    elif isinstance(artefact, BlurredRegion):
        (cx, cy), (rx, ry) = px(artefact.centre), artefact.radii
        rx, ry = rx / ds * s, ry / ds * s
        draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=255)
    else:
        cx, cy = px(artefact.centre)
        outer = artefact.radius / ds * s
        inner = max(0.0, (artefact.radius - artefact.rim) / ds * s)
        if part in ("all", "rim"):
            draw.ellipse((cx - outer, cy - outer, cx + outer, cy + outer), fill=255)
        if part == "rim":
            draw.ellipse((cx - inner, cy - inner, cx + inner, cy + inner), fill=0)
        elif part == "inside":
            draw.ellipse((cx - inner, cy - inner, cx + inner, cy + inner), fill=255)
    # PIL's box reduce: ~10x faster than a numpy mean over a reshaped array
    share: npt.NDArray[np.float32] = np.asarray(canvas.reduce(s), dtype=np.float32) / 255.0
    return share


Painter = Callable[[float, float], npt.NDArray[np.uint8]]  # (l0_x, l0_y) -> one clean tile


def paint_artefacts(
    tile: npt.NDArray[np.uint8],
    artefacts: Sequence[Artefact],
    l0_x: int,
    l0_y: int,
    ds: float,
    tissue: npt.NDArray[np.bool_],
    neighbour: Painter,
) -> npt.NDArray[np.uint8]:
    """``tile`` (level pixels, top-left level-0 ``l0_x, l0_y``) with the artefacts that reach
    it painted in. ``tissue`` is the tile's tissue mask; ``neighbour(x, y)`` paints the clean
    tile at another level-0 origin of the same grid (a blur needs the pixels around)."""
    size = tile.shape[0]
    span = size * ds
    mine = [a for a in artefacts if touches(a, l0_x, l0_y, span, span)]
    if not mine:
        return tile
    out = tile.astype(np.float32)
    on_tissue = tissue.astype(np.float32)
    order = {"fold": 0, "blur": 1, "bubble": 2, "pen": 3}  # the section, the optics, the glass
    for artefact in sorted(mine, key=lambda a: order[a.kind]):
        if isinstance(artefact, Fold):
            alpha = (coverage(artefact, l0_x, l0_y, ds, size, size) * on_tissue)[..., None]
            doubled = out * out / 255.0  # optical density doubles: transmittance squared
            out = out + alpha * (doubled - out)
        elif isinstance(artefact, BlurredRegion):
            alpha = (coverage(artefact, l0_x, l0_y, ds, size, size))[..., None]
            blurred = _blurred(out, artefact.sigma / ds, l0_x, l0_y, span, neighbour)
            out = out + alpha * (blurred - out)
        elif isinstance(artefact, Bubble):
            inside = coverage(artefact, l0_x, l0_y, ds, size, size, "inside")[..., None]
            washed = 0.55 * _blurred(out, 2.0 / ds, l0_x, l0_y, span, neighbour) + 0.45 * 255.0
            out = out + inside * (washed - out)
            rim = coverage(artefact, l0_x, l0_y, ds, size, size, "rim")[..., None]
            out = out + 0.85 * rim * (_RIM_GREY - out)
        else:
            alpha = coverage(artefact, l0_x, l0_y, ds, size, size)
            alpha = ndimage.gaussian_filter(alpha, max(0.5, artefact.width * 0.04 / ds))[..., None]
            transmittance = np.array(INK_TRANSMITTANCE[artefact.ink], dtype=np.float32)
            out = out * (1.0 - alpha * (1.0 - transmittance))
    painted: npt.NDArray[np.uint8] = np.clip(out + 0.5, 0, 255).astype(np.uint8)
    return painted


def _blurred(
    tile: npt.NDArray[np.float32],
    sigma: float,
    l0_x: int,
    l0_y: int,
    span: float,
    neighbour: Painter,
) -> npt.NDArray[np.float32]:
    """``tile`` blurred with its neighbours' clean pixels around it (no dark or mirrored
    border), so a blurred region crossing tile edges has no seams of its own making."""
    if sigma < 0.3:
        return tile
    size = tile.shape[0]
    margin = min(size, math.ceil(3 * sigma))
    block = np.empty((3 * size, 3 * size, 3), dtype=np.float32)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            part = tile if dx == dy == 0 else neighbour(l0_x + dx * span, l0_y + dy * span)
            block[(dy + 1) * size : (dy + 2) * size, (dx + 1) * size : (dx + 2) * size] = part
    window = block[size - margin : 2 * size + margin, size - margin : 2 * size + margin]
    blurred = ndimage.gaussian_filter(window, (sigma, sigma, 0))
    result: npt.NDArray[np.float32] = blurred[margin : margin + size, margin : margin + size]
    return result


def truth_shares(
    artefacts: Sequence[Artefact],
    tissue: Callable[[float, float, float, int, int], npt.NDArray[np.bool_]],
    l0_size: tuple[int, int],
    l0_x: npt.NDArray[np.int64],
    l0_y: npt.NDArray[np.int64],
    footprint: float,
    ds: float = 8.0,
) -> dict[str, npt.NDArray[np.float32]]:
    """Per kind of artefact, the share of each tile (level-0 top-left ``l0_x, l0_y``, square
    ``footprint``) it covers, measured on a ``ds``-times-reduced raster. Blur and folds count
    only where there is tissue (``tissue(l0_x, l0_y, ds, w, h)``: a mask), since out-of-focus
    glass or folded nothing is no artefact; pen and bubbles count anywhere."""
    w, h = math.ceil(l0_size[0] / ds), math.ceil(l0_size[1] / ds)
    on_tissue = tissue(0.0, 0.0, ds, w, h).astype(np.float32)
    shares: dict[str, npt.NDArray[np.float32]] = {}
    for kind in ARTEFACT_KINDS:
        raster = np.zeros((h, w), dtype=np.float32)
        for artefact in artefacts:
            if artefact.kind == kind:
                np.maximum(raster, coverage(artefact, 0.0, 0.0, ds, w, h), out=raster)
        if kind in ("blur", "fold"):
            raster *= on_tissue
        shares[kind] = _box_shares(raster, ds, l0_x, l0_y, footprint)
    return shares


def _box_shares(
    raster: npt.NDArray[np.float32],
    ds: float,
    l0_x: npt.NDArray[np.int64],
    l0_y: npt.NDArray[np.int64],
    footprint: float,
) -> npt.NDArray[np.float32]:
    h, w = raster.shape
    total = np.zeros((h + 1, w + 1), dtype=np.float64)
    total[1:, 1:] = raster.cumsum(0).cumsum(1)
    x0 = np.clip(np.round(l0_x / ds).astype(np.int64), 0, w)
    y0 = np.clip(np.round(l0_y / ds).astype(np.int64), 0, h)
    x1 = np.clip(np.round((l0_x + footprint) / ds).astype(np.int64), 0, w)
    y1 = np.clip(np.round((l0_y + footprint) / ds).astype(np.int64), 0, h)
    area = np.maximum((x1 - x0) * (y1 - y0), 1)
    inside = total[y1, x1] - total[y0, x1] - total[y1, x0] + total[y0, x0]
    shares: npt.NDArray[np.float32] = (inside / area).astype(np.float32)
    return shares


def qc_layout(
    width: int,
    height: int,
    tissue: Callable[[float, float, float, int, int], npt.NDArray[np.bool_]],
    seed: int = 0,
    scale: float = 1.0,
) -> tuple[Artefact, ...]:
    """A standard set of artefacts on a slide's tissue, apart from each other: a pen stroke
    in each of four inks along a curve, three regions blurred with sigma 2, 4 and 8 level-0
    px, two folds and two bubbles (those that find room). ``scale`` multiplies every size
    (1.0 suits 0.5 um/px slides of 20k px and more; smaller slides want smaller ones)."""
    rng = np.random.default_rng([seed, 38])
    step = 64.0
    w, h = math.ceil(width / step), math.ceil(height / step)
    mask = tissue(0.0, 0.0, step, w, h)
    # points well inside tissue, spread out: each artefact gets its own neighbourhood
    deep = ndimage.binary_erosion(mask, iterations=max(1, round(600 * scale / step)))
    ys, xs = np.nonzero(deep if deep.any() else mask)
    if not len(xs):
        return ()
    order = rng.permutation(len(xs)).tolist()

    def pen(ink: Ink) -> Callable[[Point], Artefact]:
        return lambda c: PenStroke(_curve(c, 1800 * scale, rng), 260 * scale, ink)

    def blur(sigma: float) -> Callable[[Point], Artefact]:
        return lambda c: BlurredRegion(c, (1300 * scale, 1000 * scale), sigma)

    def fold(c: Point) -> Artefact:
        return Fold(_curve(c, 1500 * scale, rng), 420 * scale)

    def bubble(c: Point) -> Artefact:
        return Bubble(c, 900 * scale, 70 * scale)

    # kinds interleaved, so a slide with room for only some still gets every kind
    plan = [pen("blue"), blur(2.0), fold, bubble, pen("green"), blur(4.0), fold, bubble]
    plan += [pen("black"), blur(8.0), pen("red")]
    # each artefact at the first tissue point where its box keeps clear of the others' (so
    # every tile shows one kind of artefact); one that finds no room is left out
    margin = 300.0 * scale
    placed: list[Artefact] = []
    for make in plan:
        for i in order:
            candidate = make(((xs[i] + 0.5) * step, (ys[i] + 0.5) * step))
            x0, y0, x1, y1 = _bounds(candidate)
            inside = x0 >= 0 and y0 >= 0 and x1 <= width and y1 <= height
            if inside and not any(
                touches(other, x0 - margin, y0 - margin, x1 - x0 + 2 * margin, y1 - y0 + 2 * margin)
                for other in placed
            ):
                placed.append(candidate)
                break
    return tuple(placed)


def _curve(centre: Point, half_length: float, rng: np.random.Generator) -> tuple[Point, ...]:
    """A gently bending curve through ``centre``: a sine wave at a random angle, 48 points."""
    angle = float(rng.uniform(0, math.pi))
    bend = float(rng.uniform(0.15, 0.3)) * half_length
    t = np.linspace(-1.0, 1.0, 48)
    along, across = t * half_length, bend * np.sin(t * math.pi * float(rng.uniform(0.6, 1.2)))
    cos, sin = math.cos(angle), math.sin(angle)
    xs = centre[0] + along * cos - across * sin
    ys = centre[1] + along * sin + across * cos
    return tuple((float(x), float(y)) for x, y in zip(xs, ys, strict=True))


RULE_KINDS: dict[str, ArtefactKind] = {
    "pen": "pen",
    "blur": "blur",
    "fold": "fold",
    "bubble": "bubble",
}
POSITIVE_SHARE = 0.5  # a tile the artefact covers at least this much should be flagged
NEGATIVE_SHARE = 0.02  # a tile it covers less than this should not; in between is not scored


@dataclass(frozen=True)
class Score:
    """How a QC rule's flags compare with the painted truth over a set of tiles."""

    positives: int
    true_positives: int
    false_positives: int
    false_negatives: int

    @property
    def precision(self) -> float:
        flagged = self.true_positives + self.false_positives
        return self.true_positives / flagged if flagged else 1.0

    @property
    def recall(self) -> float:
        return self.true_positives / self.positives if self.positives else 1.0

    def __add__(self, other: Score) -> Score:
        return Score(
            self.positives + other.positives,
            self.true_positives + other.true_positives,
            self.false_positives + other.false_positives,
            self.false_negatives + other.false_negatives,
        )


def score(
    rule: str, flagged: npt.NDArray[np.bool_], truth: dict[str, npt.NDArray[np.float32]]
) -> Score:
    """A rule's flags against `truth_shares` of the same tiles: positives are tiles the
    rule's artefact covers at least `POSITIVE_SHARE`, negatives those it covers less than
    `NEGATIVE_SHARE` (for blur, and no bubble either: a bubble's inside is out of focus
    too); tiles partly covered are not scored, since either answer is defensible there."""
    share = truth[RULE_KINDS[rule]]
    positive = share >= POSITIVE_SHARE
    negative = share < NEGATIVE_SHARE
    if rule == "blur":
        negative &= truth["bubble"] < NEGATIVE_SHARE
    return Score(
        positives=int(positive.sum()),
        true_positives=int((flagged & positive).sum()),
        false_positives=int((flagged & negative).sum()),
        false_negatives=int((~flagged & positive).sum()),
    )
