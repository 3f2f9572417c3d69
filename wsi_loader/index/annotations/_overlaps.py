"""Exact area of one class inside cells where several of its outlines meet, without overlay.

The class's region there is (union of its bodies) minus (union of its holes). Its boundary is
made of the outline pieces that survive: a body's outline where it lies outside every other
body and every hole, a hole's outline (reversed) where it lies inside some body and outside
every other hole, and the parts of the cell's border that lie inside the region. Outline
pieces are split where outlines of different shapes cross, so each sub-piece is wholly
inside or outside each other shape; one point-in-polygon test at its midpoint decides it.
The shoelace sum over the surviving boundary is the area (Green's theorem).

All cells of a class are done together in numpy; GEOS only answers point-in-polygon queries
(~0.25 us each). The degenerate cases, where two outlines run along each other or a test
point lies on an outline (shared borders between annotations, shapes drawn along the cell's
border), are reported back so the caller computes those cells with polygon overlay instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import shapely
from shapely.geometry.base import BaseGeometry

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
TINY = 1e-12  # relative to a cell's size: below it two outlines are taken to coincide
MAX_PAIRS = 200_000  # piece pairs tested per cell; a denser cell goes to polygon overlay


def expand(first: Ints, count: Ints) -> tuple[Ints, Ints]:
    """For each i the integers first[i] .. first[i] + count[i] - 1, and i for each."""
    owner = np.repeat(np.arange(len(count)), count)
    offset = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return owner, first[owner] + offset


def meeting_pairs(group: Ints, shape: Ints, bounds: Floats) -> tuple[Ints, Ints]:
    """Pairs (a, b), a < b, of entries of one group (``group`` sorted: a cell) whose shapes'
    bounding boxes meet (``bounds``: per shape). Groups of many small disjoint shapes, e.g.
    cell detections, pair almost nothing; a group of k entries costs k^2 / 2 box tests."""
    first = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    size = np.diff(np.r_[first, len(group)])
    position = np.arange(len(group)) - np.repeat(first, size)
    later = np.repeat(size, size) - position - 1
    a, b = expand(np.arange(len(later)) + 1, later)  # each entry with the later ones
    a_box, b_box = bounds[shape[a]], bounds[shape[b]]
    near = (
        (a_box[:, 0] <= b_box[:, 2])
        & (b_box[:, 0] <= a_box[:, 2])
        & (a_box[:, 1] <= b_box[:, 3])
        & (b_box[:, 1] <= a_box[:, 3])
    )
    return a[near], b[near]


@dataclass
class Outline:
    """Oriented outline pieces of one class inside the cells to measure: endpoints relative to
    the cell's corner, the cell (index into the cells measured) and the shape of each piece."""

    cell: Ints
    shape: Ints
    xa: Floats
    ya: Floats
    xb: Floats
    yb: Floats


class Shapes:
    """All shapes of a slide for the tests here: prepared geometries, hole flags, classes,
    bounding boxes and a spatial index (built once, used by every chunk of cells)."""

    def __init__(
        self, geometries: Sequence[BaseGeometry], hole: Bools, klass: Ints, bounds: Floats
    ) -> None:
        self.geometries = np.asarray(geometries, dtype=object)
        shapely.prepare(self.geometries)
        self.hole, self.klass, self.bounds = hole, klass, bounds
        self.tree = shapely.STRtree(self.geometries)


@dataclass
class Cells:
    """The cells to measure: their corners and sizes (level-0 px), the class measured in each
    and whether a body of that class covers it whole."""

    klass: Ints
    x0: Floats
    y0: Floats
    width: Floats
    height: Floats
    body_full: Bools


def region_areas(outline: Outline, cells: Cells, shapes: Shapes) -> tuple[Floats, Bools]:
    """Each cell's class's area there, and which cells are degenerate (area not computed)."""
    n = len(cells.x0)
    size = np.maximum(cells.width, cells.height)
    degenerate = np.zeros(n, dtype=bool)
    sub, crossing_bad, alone = _split_at_crossings(outline, size, shapes.bounds)
    degenerate[crossing_bad] = True
    mid_x, mid_y = (sub.xa + sub.xb) / 2, (sub.ya + sub.yb) / 2
    # a midpoint cannot lie on another outline: that outline would cross the piece there (a
    # cut) or run along it (degenerate above). Pieces of a shape alone in its cell need no test.
    in_body, in_hole = cells.body_full[sub.cell].copy(), np.zeros(len(sub.cell), dtype=bool)
    ask = np.flatnonzero(~alone)
    in_body[ask], in_hole[ask], _ = _inside(
        sub.cell[ask], sub.shape[ask], mid_x[ask], mid_y[ask], cells, shapes, False
    )
    own_hole = shapes.hole[sub.shape]
    keep = np.where(own_hole, in_body & ~in_hole, ~in_body & ~in_hole)
    # a kept hole piece bounds the region with the region on its other side: reversed
    xa = np.where(own_hole, sub.xb, sub.xa)[keep]
    ya = np.where(own_hole, sub.yb, sub.ya)[keep]
    xb = np.where(own_hole, sub.xa, sub.xb)[keep]
    yb = np.where(own_hole, sub.ya, sub.yb)[keep]
    cell = sub.cell[keep]
    area = np.bincount(cell, weights=xa * yb - xb * ya, minlength=n)
    border, border_bad = _border(cell, xa, ya, xb, yb, cells, shapes)
    degenerate[border_bad] = True
    return (area + border) / 2, degenerate


def _split_at_crossings(
    outline: Outline, size: Floats, bounds: Floats
) -> tuple[Outline, Ints, Bools]:
    """The pieces cut where they cross pieces of other shapes in the same cell, the cells
    where two pieces of different shapes overlap along a line, and for each cut piece whether
    its shape has no neighbour there (no other shape's box meets its box in that cell)."""
    # runs of pieces of one shape in one cell (sorted by cell, then shape)
    order = np.lexsort((outline.shape, outline.cell))
    cell, shape = outline.cell[order], outline.shape[order]
    start = np.flatnonzero(np.r_[True, (cell[1:] != cell[:-1]) | (shape[1:] != shape[:-1])])
    length = np.diff(np.r_[start, len(cell)])
    run_cell, run_shape = cell[start], shape[start]
    a, b = meeting_pairs(run_cell, run_shape, bounds)  # only their pieces can cross
    # pieces of a shape with no such neighbour in its cell lie inside no other shape there
    alone = np.ones(len(outline.cell), dtype=bool)
    partnered = np.zeros(len(start), dtype=bool)
    partnered[a] = partnered[b] = True
    alone[order[np.repeat(partnered, length)]] = False
    # a cell tangled past MAX_PAIRS (e.g. copies of an outline crossing itself thousands of
    # times) would cost the square of its pieces here: it is left to the caller's overlay
    count = length[a] * length[b]
    pairs = np.bincount(run_cell[a], weights=count, minlength=len(size))
    dense = np.flatnonzero(pairs > MAX_PAIRS)
    keep = ~np.isin(run_cell[a], dense)
    a, b, count = a[keep], b[keep], count[keep]
    pair, k = expand(np.zeros(len(count), dtype=np.int64), count)  # k: index in the pair
    i = order[start[a[pair]] + k // length[b[pair]]]
    j = order[start[b[pair]] + k % length[b[pair]]]
    ax, ay = outline.xa[i], outline.ya[i]
    rx, ry = outline.xb[i] - ax, outline.yb[i] - ay
    qx, qy = outline.xa[j] - ax, outline.ya[j] - ay
    sx, sy = outline.xb[j] - outline.xa[j], outline.yb[j] - outline.ya[j]
    denominator = rx * sy - ry * sx
    scale = size[outline.cell[i]]
    parallel = np.abs(denominator) <= TINY * scale * scale
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (qx * sy - qy * sx) / denominator
        u = (qx * ry - qy * rx) / denominator
    meets = ~parallel & (t >= 0) & (t <= 1) & (u >= 0) & (u <= 1)
    # parallel pieces on one line that overlap: shared borders, handled by the caller
    on_line = parallel & (np.abs(qx * ry - qy * rx) <= TINY * scale * scale)
    length2 = np.maximum(rx * rx + ry * ry, TINY)
    s0 = (qx * rx + qy * ry) / length2
    s1 = ((qx + sx) * rx + (qy + sy) * ry) / length2
    overlap = on_line & (np.minimum(np.maximum(s0, s1), 1) - np.maximum(np.minimum(s0, s1), 0) > 0)
    bad = np.union1d(outline.cell[i[overlap]], dense)
    # cut points: parameters along each piece, 0 and 1 for its ends
    n = len(outline.cell)
    piece = np.concatenate([np.arange(n), np.arange(n), i[meets], j[meets]])
    at = np.concatenate([np.zeros(n), np.ones(n), t[meets], u[meets]])
    order = np.lexsort((at, piece))
    piece, at = piece[order], at[order]
    cut = np.flatnonzero((piece[1:] == piece[:-1]) & (at[1:] > at[:-1]))  # not zero-length
    p, ta, tb = piece[cut], at[cut], at[cut + 1]
    dx, dy = outline.xb[p] - outline.xa[p], outline.yb[p] - outline.ya[p]
    sub = Outline(
        cell=outline.cell[p],
        shape=outline.shape[p],
        xa=outline.xa[p] + ta * dx,
        ya=outline.ya[p] + ta * dy,
        xb=outline.xa[p] + tb * dx,
        yb=outline.ya[p] + tb * dy,
    )
    # ends keep their exact values (a piece's end on the cell border stays on it)
    sub.xa[ta == 0], sub.ya[ta == 0] = outline.xa[p][ta == 0], outline.ya[p][ta == 0]
    sub.xb[tb == 1], sub.yb[tb == 1] = outline.xb[p][tb == 1], outline.yb[p][tb == 1]
    return sub, bad, alone[p]


def _inside(
    cell: Ints, shape: Ints, x: Floats, y: Floats, cells: Cells, shapes: Shapes, boundary: bool
) -> tuple[Bools, Bools, Bools]:
    """For points (relative to their cell's corner), whether a body of the cell's class other
    than ``shape`` holds them (or covers the cell), whether such a hole does, and (with
    ``boundary``) whether one lies on an outline of such a shape. Candidates come from the
    spatial index (boxes holding the point), so the tests stay few among many small shapes."""
    in_body = cells.body_full[cell].copy()
    in_hole = np.zeros(len(cell), dtype=bool)
    on_line = np.zeros(len(cell), dtype=bool)
    gx, gy = x + cells.x0[cell], y + cells.y0[cell]
    point, other = shapes.tree.query(shapely.points(gx, gy))
    mine = (other != shape[point]) & (shapes.klass[other] == cells.klass[cell[point]])
    point, other = point[mine], other[mine]
    geometry = shapes.geometries[other]
    inside = shapely.contains_xy(geometry, gx[point], gy[point])
    if boundary:
        touches = shapely.intersects_xy(geometry, gx[point], gy[point])
        on_line[point[touches & ~inside]] = True
    hole = shapes.hole[other]
    in_hole[point[inside & hole]] = True
    in_body[point[inside & ~hole]] = True
    return in_body, in_hole, on_line


def _border(
    cell: Ints,
    xa: Floats,
    ya: Floats,
    xb: Floats,
    yb: Floats,
    cells: Cells,
    shapes: Shapes,
) -> tuple[Floats, Ints]:
    """Twice the shoelace area of the cell-border stretches inside the region, per cell, and
    the cells where a border test point lies on an outline.

    The region's boundary meets a cell's border only at the ends of surviving pieces; between
    those points (and the corners) each stretch is wholly inside or outside."""
    n = len(cells.x0)
    w, h = cells.width, cells.height
    # the border as one loop, counter-clockwise in the shoelace sense: position s along it
    # runs 0..w on y=0, w..w+h on x=w, w+h..2w+h on y=h and 2w+h..2w+2h on x=0
    ex = np.concatenate([xa, xb])
    ey = np.concatenate([ya, yb])
    ec = np.concatenate([cell, cell])
    wc, hc = w[ec], h[ec]
    s = np.full(len(ex), np.nan)
    s = np.where(ey == 0, ex, s)
    s = np.where(ex == wc, wc + ey, s)
    s = np.where(ey == hc, 2 * wc + hc - ex, s)
    s = np.where((ex == 0) & (ey > 0), 2 * wc + 2 * hc - ey, s)
    on = np.isfinite(s)
    corners = np.stack([np.zeros(n), w, w + h, 2 * w + h, 2 * w + 2 * h], axis=1)
    point_cell = np.concatenate([ec[on], np.repeat(np.arange(n), 5)])
    point_s = np.concatenate([s[on], corners.ravel()])
    order = np.lexsort((point_s, point_cell))
    point_cell, point_s = point_cell[order], point_s[order]
    stretch = np.flatnonzero((point_cell[1:] == point_cell[:-1]) & (point_s[1:] > point_s[:-1]))
    c, s0, s1 = point_cell[stretch], point_s[stretch], point_s[stretch + 1]
    x0, y0 = _on_border(s0, w[c], h[c])
    x1, y1 = _on_border(s1, w[c], h[c])
    mx, my = _on_border((s0 + s1) / 2, w[c], h[c])
    in_body, in_hole, on_line = _inside(c, np.full(len(c), -1), mx, my, cells, shapes, True)
    inside = in_body & ~in_hole
    twice = np.bincount(c[inside], weights=(x0 * y1 - x1 * y0)[inside], minlength=n)
    return twice.astype(np.float64), np.unique(c[on_line]).astype(np.int64)


def _on_border(s: Floats, w: Floats, h: Floats) -> tuple[Floats, Floats]:
    """The point at position ``s`` along a w x h cell's border loop (see `_border`)."""
    x = np.select([s <= w, s <= w + h, s <= 2 * w + h], [s, w, 2 * w + h - s], np.zeros_like(s))
    y = np.select(
        [s <= w, s <= w + h, s <= 2 * w + h], [np.zeros_like(s), s - w, h], 2 * w + 2 * h - s
    )
    return x, y
