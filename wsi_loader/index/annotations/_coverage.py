"""The share of each tile covered by each class, computed exactly from the outlines.

Green's theorem on a lattice (the tiles' edges plus the slide's borders), the way font
rasterisers compute exact pixel coverage: every polygon edge is cut where it crosses a lattice
line, and each piece adds its signed area to its own cell and, through a prefix sum along the
row, a full-width strip to every cell right of it. The result is each shape's exact area in
every cell, linear in the number of vertices, with no polygon overlay (class unions, then
tile boxes intersected with shapely, cost several times more: benchmarks/README.md,
"Annotation coverage"). A raster within 1% at a 256 px tile would need ~10 px cells and still
err on thin regions.

Shapes of one class may overlap, and a class's holes (Aperio negative regions, ASAP exclusion
groups) are cut out of it; sums of areas are wrong there. So every cell is resolved by a rule
from the per-shape areas: a shape that covers the cell decides it; a cell crossed by a single
outline takes that shape's area. Cells crossed by two or more outlines of one class (and
covered by none; a few percent of the cells) are measured by `_overlaps`, which
keeps the outline pieces that bound the class there; where outlines run along each other, a
polygon overlay (shapely's intersection with that cell alone) decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, reduce

import numpy as np
import numpy.typing as npt
import shapely
from shapely.geometry.base import BaseGeometry

from wsi_loader.index.annotations._overlaps import (
    Cells,
    Outline,
    Shapes,
    expand,
    meeting_pairs,
    region_areas,
)
from wsi_loader.index.annotations._shapes import Shape, polygonal

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
EPS = 1e-9  # relative to a cell's area: below it an area is 0, above 1 - EPS it is full
POLYGON = 3  # shapely.get_type_id of a Polygon
FEW_TO_UNITE = 16  # geometries united pairwise; more in one unary union
MAX_OUTLINES = 256  # outlines of a class crossing a cell that the outline pass measures
CHUNK_PAIRS = 2_000_000  # outline piece pairs measured at once in cells where outlines meet


@dataclass(frozen=True)
class Lattice:
    """Vertical lines ``xs`` and horizontal lines ``ys`` (sorted, level-0 pixels) cutting the
    slide into cells: every tile is a block of whole cells."""

    xs: Floats
    ys: Floats
    width: float
    height: float

    @classmethod
    def for_tiles(
        cls, l0_x: npt.ArrayLike, l0_y: npt.ArrayLike, footprint: float, size: tuple[int, int]
    ) -> Lattice:
        x = np.asarray(l0_x, dtype=np.float64)
        y = np.asarray(l0_y, dtype=np.float64)
        width, height = float(size[0]), float(size[1])
        xs = np.unique(np.concatenate([[0.0, width], x, x + footprint]))
        ys = np.unique(np.concatenate([[0.0, height], y, y + footprint]))
        return cls(xs=xs, ys=ys, width=width, height=height)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.ys) - 1, len(self.xs) - 1

    def cell_area(self) -> Floats:
        return np.outer(np.diff(self.ys), np.diff(self.xs))

    def on_slide(self) -> npt.NDArray[np.bool_]:
        """Cells inside the slide (tiles at the border may reach past it)."""
        cx = (self.xs[:-1] + self.xs[1:]) / 2
        cy = (self.ys[:-1] + self.ys[1:]) / 2
        return np.outer((cy > 0) & (cy < self.height), (cx > 0) & (cx < self.width))

    def per_tile(
        self, areas: Floats, l0_x: npt.ArrayLike, l0_y: npt.ArrayLike, footprint: float
    ) -> npt.NDArray[np.float32]:
        """Each tile's share of ``areas`` (per cell, level-0 px^2): a summed-area table."""
        x = np.asarray(l0_x, dtype=np.float64)
        y = np.asarray(l0_y, dtype=np.float64)
        table = np.zeros((areas.shape[0] + 1, areas.shape[1] + 1))
        table[1:, 1:] = areas.cumsum(axis=0).cumsum(axis=1)
        x0, x1 = np.searchsorted(self.xs, x), np.searchsorted(self.xs, x + footprint)
        y0, y1 = np.searchsorted(self.ys, y), np.searchsorted(self.ys, y + footprint)
        total = table[y1, x1] - table[y0, x1] - table[y1, x0] + table[y0, x0]
        return np.clip(total / float(footprint) ** 2, 0.0, 1.0).astype(np.float32)


@dataclass
class _Pieces:
    """Polygon edges cut at lattice lines: each piece lies in one row and one column (column
    -1: left of the lattice, where it only raises the cells right of it). Endpoints run with
    the shape's inside on the left (shoelace-positive), holes reversed; cut points sit exactly
    on their lattice line."""

    shape: Ints  # which shape the piece belongs to
    row: Ints
    col: Ints
    xa: Floats
    ya: Floats
    xb: Floats
    yb: Floats
    rise: Floats  # signed height: ya - yb
    inner: Floats  # signed area between the piece and its cell's right edge


def _edges(
    geometries: Sequence[BaseGeometry],
) -> tuple[Floats, Floats, Floats, Floats, Ints, Floats]:
    """Every ring edge of the shapes (x0, y0, x1, y1), the shape it belongs to, and a sign that
    makes outer rings count +1 and holes -1 whatever the file's winding order."""
    array = np.asarray(geometries, dtype=object)
    if (shapely.get_type_id(array) == POLYGON).all() and not shapely.get_num_interior_rings(
        array
    ).any():
        # polygons without holes (cell detections: 100,000s) are their own rings: copying
        # them into parts and rings took longer than the rest of this function
        rings, shape_of_part = array, np.arange(len(array))
        part_of_ring, outer = shape_of_part, np.ones(len(array), dtype=bool)
    else:
        parts, shape_of_part = shapely.get_parts(array, return_index=True)
        rings, part_of_ring = shapely.get_rings(parts, return_index=True)
        outer = np.ones(len(rings), dtype=bool)
        outer[1:] = part_of_ring[1:] != part_of_ring[:-1]  # a polygon's first ring: its shell
    coords, ring_of = shapely.get_coordinates(rings, return_index=True)
    same = ring_of[1:] == ring_of[:-1]  # rings are closed: consecutive points of one ring
    start, end, ring = coords[:-1][same], coords[1:][same], ring_of[:-1][same]
    x0, y0, x1, y1 = start[:, 0], start[:, 1], end[:, 0], end[:, 1]
    twice_area = np.bincount(ring, weights=x0 * y1 - x1 * y0, minlength=len(rings))
    sign = np.where(outer, 1.0, -1.0) * np.sign(twice_area)
    return x0, y0, x1, y1, shape_of_part[part_of_ring[ring]], sign[ring]


def _pieces(geometries: Sequence[BaseGeometry], lattice: Lattice) -> _Pieces:
    x0, y0, x1, y1, shape, sign = _edges(geometries)
    xs, ys = lattice.xs, lattice.ys
    ix0, ix1 = np.searchsorted(xs, x0), np.searchsorted(xs, x1)
    iy0, iy1 = np.searchsorted(ys, y0), np.searchsorted(ys, y1)
    nx, ny = np.abs(ix1 - ix0), np.abs(iy1 - iy0)
    # an edge inside one cell is one piece; the others are cut at the lattice lines they cross
    # (parameter t along the edge; the cut point is put exactly on its line)
    crossing = np.flatnonzero((nx + ny) > 0)
    whole = np.flatnonzero((nx + ny) == 0)
    ex, kx = expand(np.minimum(ix0, ix1)[crossing], nx[crossing])
    ey, ky = expand(np.minimum(iy0, iy1)[crossing], ny[crossing])
    ex, ey = crossing[ex], crossing[ey]
    tx = (xs[kx] - x0[ex]) / (x1[ex] - x0[ex])
    ty = (ys[ky] - y0[ey]) / (y1[ey] - y0[ey])
    edge = np.concatenate([crossing, crossing, ex, ey])
    t = np.concatenate([np.zeros(len(crossing)), np.ones(len(crossing)), tx, ty])
    px = np.concatenate([x0[crossing], x1[crossing], xs[kx], x0[ey] + ty * (x1 - x0)[ey]])
    py = np.concatenate([y0[crossing], y1[crossing], y0[ex] + tx * (y1 - y0)[ex], ys[ky]])
    # by edge, then along it: one float key sorts ~10x faster than lexsort of the two. Points
    # closer along an edge than the key resolves (~1e-11 of it) keep their order of creation,
    # which moves an area below 1e-6 px^2 between the cells meeting there
    order = np.argsort(edge * 2.0 + t, kind="stable")
    edge, px, py = edge[order], px[order], py[order]
    cut = np.flatnonzero(edge[1:] == edge[:-1])
    piece_edge = np.concatenate([whole, edge[cut]])
    xa, ya = np.concatenate([x0[whole], px[cut]]), np.concatenate([y0[whole], py[cut]])
    xb, yb = np.concatenate([x1[whole], px[cut + 1]]), np.concatenate([y1[whole], py[cut + 1]])
    n_rows, n_cols = lattice.shape
    mid_x, mid_y = (xa + xb) / 2, (ya + yb) / 2
    col = np.concatenate([ix0[whole] - 1, np.searchsorted(xs, mid_x[len(whole) :]) - 1])
    row = np.concatenate([iy0[whole] - 1, np.searchsorted(ys, mid_y[len(whole) :]) - 1])
    # horizontal pieces add no area but say which cells an outline crosses
    inside = (row >= 0) & (row < n_rows) & (col < n_cols)
    backwards = sign[piece_edge][inside] < 0
    xa, xb = (
        np.where(backwards, xb[inside], xa[inside]),
        np.where(backwards, xa[inside], xb[inside]),
    )
    ya, yb = (
        np.where(backwards, yb[inside], ya[inside]),
        np.where(backwards, ya[inside], yb[inside]),
    )
    col, row, mid_x = col[inside], row[inside], mid_x[inside]
    rise = ya - yb  # counter-clockwise (shoelace > 0) shells count +
    right = xs[np.clip(col + 1, 0, n_cols)]
    inner = np.where(col >= 0, rise * (right - mid_x), 0.0)
    return _Pieces(shape[piece_edge][inside], row, col, xa, ya, xb, yb, rise, inner)


def _dense(pieces: _Pieces, group: Ints, n_groups: int, lattice: Lattice) -> Floats:
    """Area per cell of each group of shapes (``group[shape]``), overlaps counted twice."""
    n_rows, n_cols = lattice.shape
    key = (group[pieces.shape] * n_rows + pieces.row) * (n_cols + 1) + pieces.col + 1
    size = n_groups * n_rows * (n_cols + 1)
    inner = np.bincount(key, weights=pieces.inner, minlength=size)
    # a piece raises the cells right of it: none for a piece in the last column
    rise = np.where(pieces.col < n_cols - 1, pieces.rise, 0.0)
    step = np.bincount(key + 1, weights=rise, minlength=size + 1)[:size]
    inner = inner.reshape(n_groups, n_rows, n_cols + 1)[:, :, 1:]
    height = step.reshape(n_groups, n_rows, n_cols + 1).cumsum(axis=2)[:, :, 1:]
    return inner + height * np.diff(lattice.xs)


def _touched(pieces: _Pieces, lattice: Lattice) -> tuple[Ints, Ints, Floats]:
    """The cells each shape's outline crosses: (shape, flat cell, the shape's area there)."""
    n_rows, n_cols = lattice.shape
    key = (pieces.shape * n_rows + pieces.row) * (n_cols + 1) + pieces.col + 1
    unique, inverse = np.unique(key, return_inverse=True)
    inner = np.bincount(inverse, weights=pieces.inner)
    rise = np.bincount(inverse, weights=pieces.rise)
    line = unique // (n_cols + 1)  # (shape, row)
    col = unique % (n_cols + 1) - 1
    # the rise of the same shape's pieces left of the cell in the row raises the whole cell
    total = np.cumsum(rise)
    first = np.ones(len(unique), dtype=bool)
    first[1:] = line[1:] != line[:-1]
    start = np.flatnonzero(first)
    before = total - rise - (total - rise)[start][np.cumsum(first) - 1]
    width = np.diff(lattice.xs)
    area = inner + before * width[np.clip(col, 0, n_cols - 1)]
    on = col >= 0
    return line[on] // n_rows, (line[on] % n_rows) * n_cols + col[on], area[on]


def _union(geometries: Sequence[BaseGeometry]) -> BaseGeometry:
    """The union of geometries: a few pairwise (GEOS's unary union of two 30-vertex pieces
    measured up to ~40x slower than a binary union), many at once (pairwise, each union
    grows: 3,000 overlapping squares took 19 s)."""
    if len(geometries) > FEW_TO_UNITE:
        return shapely.union_all(geometries)
    return reduce(shapely.union, geometries) if geometries else shapely.Polygon()


def _within(shapes: Sequence[Shape], lattice: Lattice) -> list[Shape]:
    """The shapes clipped to the lattice (the slide, and tiles reaching past its border),
    those wholly outside left out. An outline with vertices far away (+-1e18) would otherwise
    be cut at the lattice lines in float64 with an error far beyond a pixel: such an outline
    around a slide covered 11 of its 77 tiles."""
    if not shapes:
        return []
    geometries = np.asarray([s.geometry for s in shapes], dtype=object)
    x0, x1, y0, y1 = lattice.xs[0], lattice.xs[-1], lattice.ys[0], lattice.ys[-1]
    b = shapely.bounds(geometries)
    outside = (b[:, 0] < x0) | (b[:, 1] < y0) | (b[:, 2] > x1) | (b[:, 3] > y1)
    if not outside.any():
        return list(shapes)
    clipped = geometries.copy()
    clipped[outside] = shapely.intersection(geometries[outside], shapely.box(x0, y0, x1, y1))
    kept = []
    for shape, part, moved in zip(shapes, clipped, outside.tolist(), strict=True):
        if not moved:
            kept.append(shape)
            continue
        inside = polygonal(part)  # an intersection may add lines or points
        if not inside.is_empty and inside.area > 0:
            kept.append(Shape(shape.name, inside, shape.hole))
    return kept


class ClassCells:
    """One slide's shapes on a lattice: per class, the exact area it covers in every cell."""

    def __init__(self, shapes: Sequence[Shape], lattice: Lattice) -> None:
        self.lattice = lattice
        self.names = sorted({s.name for s in shapes})  # a class wholly outside still counts
        shapes = _within(shapes, lattice)
        self.shapes = list(shapes)
        n_classes, cells = len(self.names), lattice.shape[0] * lattice.shape[1]
        self.cell_area = lattice.cell_area().ravel()
        self.on_slide = lattice.on_slide().ravel()
        self.cells = np.zeros((n_classes, cells))
        if not shapes:
            return
        position = {n: i for i, n in enumerate(self.names)}
        klass = np.array([position[s.name] for s in shapes], dtype=np.int64)
        hole = np.array([s.hole for s in shapes], dtype=bool)
        pieces = _pieces([s.geometry for s in shapes], lattice)
        sums = _dense(pieces, klass * 2 + hole, 2 * n_classes, lattice).reshape(n_classes, 2, -1)
        shape, cell, area = _touched(pieces, lattice)
        share = area / self.cell_area[cell]
        kind = klass[shape] * 2 + hole[shape]
        flat = kind * cells + cell
        crossing = np.bincount(flat, minlength=2 * n_classes * cells).reshape(n_classes, 2, -1)
        crossed = np.bincount(flat, weights=share, minlength=2 * n_classes * cells).astype(float)
        full = np.rint(sums / self.cell_area - crossed.reshape(n_classes, 2, -1))
        order = np.argsort(cell, kind="stable")  # the shapes crossing each cell, by cell
        self._touching = (shape[order], cell[order])
        self._pieces, self._klass, self._hole = pieces, klass, hole
        self._body_full = full[:, 0] >= 1  # a body of the class covers the whole cell
        self.cells = self._resolve(full, crossing, crossed.reshape(n_classes, 2, -1))
        self.cells *= self.on_slide

    def _resolve(self, full: Floats, crossing: npt.NDArray[np.intp], crossed: Floats) -> Floats:
        """Every class's covered share of every cell from the per-shape areas (module doc)."""
        body_full, hole_full = full[:, 0] >= 1, full[:, 1] >= 1
        n_body, n_hole = crossing[:, 0], crossing[:, 1]
        body, hole = crossed[:, 0], crossed[:, 1]
        value = np.where(body_full, 1.0, np.where(n_body == 1, body, 0.0))
        value = np.where(n_hole == 1, np.clip(value - hole, 0.0, 1.0), value)
        empty = ~body_full & (n_body == 0)
        settled = hole_full | empty | (n_hole + np.where(body_full, 0, n_body) <= 1)
        value[hole_full | empty] = 0.0
        classes, cells = np.nonzero(~settled)
        # a cell crossed by more outlines of a class than MAX_OUTLINES (copies of one outline
        # stacked by a broken or hostile export) would cost the square of them below
        stacked = n_body[classes, cells] + n_hole[classes, cells] > MAX_OUTLINES
        # bodies whose boxes meet no other there are apart: their areas add (cell detections:
        # thousands of small outlines of one class in a tile)
        apart = ~stacked & (n_hole[classes, cells] == 0)
        apart[apart] = self._apart(classes[apart], cells[apart])
        value[classes[apart], cells[apart]] = np.minimum(body[classes[apart], cells[apart]], 1)
        measure = np.flatnonzero(~stacked & ~apart)
        overlay = stacked
        if len(measure):
            areas, degenerate = self._overlapping(classes[measure], cells[measure])
            value[classes[measure], cells[measure]] = areas / self.cell_area[cells[measure]]
            overlay[measure[degenerate]] = True  # outlines running along each other
        for k, cell in zip(classes[overlay].tolist(), cells[overlay].tolist(), strict=True):
            value[k, cell] = self._in_box(k, cell).area / self.cell_area[cell]
        return value

    @cached_property
    def _bounds(self) -> Floats:
        """Each shape's bounding box (x0, y0, x1, y1)."""
        bounds: Floats = shapely.bounds(np.asarray([s.geometry for s in self.shapes], dtype=object))
        return bounds

    def _apart(self, classes: Ints, cells: Ints) -> npt.NDArray[np.bool_]:
        """For (class, cell) units (sorted), whether the boxes of the class's outlines crossing
        the cell meet none of each other's (so the shapes do not overlap there)."""
        if not len(classes):
            return np.zeros(0, dtype=bool)
        n_cells = len(self.cell_area)
        units = classes * n_cells + cells
        shapes, touched = self._touching
        key = self._klass[shapes] * n_cells + touched
        at = np.minimum(np.searchsorted(units, key), len(units) - 1)
        mine = np.flatnonzero(units[at] == key)
        order = np.argsort(at[mine], kind="stable")
        unit, shape = at[mine][order], shapes[mine][order]
        a, _ = meeting_pairs(unit, shape, self._bounds)
        apart = np.ones(len(units), dtype=bool)
        apart[unit[a]] = False
        return apart

    def _overlapping(self, classes: Ints, cells: Ints) -> tuple[Floats, npt.NDArray[np.bool_]]:
        """Each class's area in the cells (sorted by class, then cell) crossed by several of
        its outlines (`_overlaps`); a shape only meets the shapes of its own class there.
        Done in chunks of about `CHUNK_PAIRS` piece pairs, so memory stays bounded on
        archives of overlapping annotations."""
        n_cells = len(self.cell_area)
        n_cols = self.lattice.shape[1]
        pieces = self._pieces
        units = classes * n_cells + cells  # sorted
        key = self._klass[pieces.shape] * n_cells + pieces.row * n_cols + pieces.col
        at = np.minimum(np.searchsorted(units, key), len(units) - 1)
        mine = np.flatnonzero((pieces.col >= 0) & (units[at] == key))
        by_unit = np.argsort(at[mine], kind="stable")  # so that a chunk is a slice
        mine, at = mine[by_unit], at[mine][by_unit]
        pairs = np.bincount(at, minlength=len(units)).astype(np.float64) ** 2 / 2  # at most
        ends = np.searchsorted(
            np.cumsum(pairs), np.arange(1, 1 + pairs.sum() // CHUNK_PAIRS) * CHUNK_PAIRS
        )
        bounds = np.unique(np.r_[0, ends + 1, len(units)].clip(0, len(units)))
        areas, degenerate = np.zeros(len(units)), np.zeros(len(units), dtype=bool)
        geometries = [s.geometry for s in self.shapes]
        shapes = Shapes(geometries, self._hole, self._klass, self._bounds)
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            chunk = slice(np.searchsorted(at, lo), np.searchsorted(at, hi))
            some, part = mine[chunk], at[chunk] - lo
            rows, cols = np.divmod(cells[lo:hi], n_cols)
            x0, y0 = self.lattice.xs[cols], self.lattice.ys[rows]
            outline = Outline(
                cell=part,
                shape=pieces.shape[some],
                xa=pieces.xa[some] - x0[part],
                ya=pieces.ya[some] - y0[part],
                xb=pieces.xb[some] - x0[part],
                yb=pieces.yb[some] - y0[part],
            )
            region = Cells(
                klass=classes[lo:hi],
                x0=x0,
                y0=y0,
                width=self.lattice.xs[cols + 1] - x0,
                height=self.lattice.ys[rows + 1] - y0,
                body_full=self._body_full[classes[lo:hi], cells[lo:hi]],
            )
            areas[lo:hi], degenerate[lo:hi] = region_areas(outline, region, shapes)
        return areas, degenerate

    def _box(self, cell: int) -> tuple[float, float, float, float]:
        n_cols = self.lattice.shape[1]
        row, col = divmod(cell, n_cols)
        xs, ys = self.lattice.xs, self.lattice.ys
        return float(xs[col]), float(ys[row]), float(xs[col + 1]), float(ys[row + 1])

    def _in_box(self, k: int, cell: int) -> BaseGeometry:
        """Class ``k`` inside one cell, as geometry (its crossing shapes clipped to the cell)."""
        box = self._box(cell)
        shapes, cells = self._touching
        crossing = shapes[np.searchsorted(cells, cell) : np.searchsorted(cells, cell, "right")]
        name = self.names[k]
        mine = [self.shapes[i] for i in crossing.tolist() if self.shapes[i].name == name]
        square = shapely.box(*box)

        def clipped(hole: bool) -> list[BaseGeometry]:
            # an overlay, not shapely.clip_by_rect: that may return invalid polygons (copies
            # of an outline, repeated vertices), whose union is then wrong or a GEOS error
            found = [s.geometry for s in mine if s.hole == hole]
            return list(shapely.intersection(np.asarray(found, dtype=object), square))

        bodies = square if self._body_full[k, cell] else _union(clipped(hole=False))
        holes = clipped(hole=True)
        return shapely.difference(bodies, _union(holes)) if holes else bodies

    def areas(self) -> dict[str, float]:
        """Each class's area on the slide (level-0 px^2)."""
        # (a product and a sum, not a BLAS dot: see _shapes._flat)
        return {n: float((self.cells[i] * self.cell_area).sum()) for i, n in enumerate(self.names)}

    def share(self, name: str) -> Floats:
        """The class's covered share per cell (0 for a class without shapes)."""
        if name not in self.names:
            return np.zeros(self.cells.shape[1])
        share: Floats = self.cells[self.names.index(name)]
        return share

    def union(self, names: Sequence[str]) -> Floats:
        """The covered share of several classes together (overlaps between them once)."""
        rows = [self.names.index(n) for n in names if n in self.names]
        if not rows:
            return np.zeros(self.cells.shape[1])
        cells = self.cells[rows]
        partial = (cells > EPS) & (cells < 1 - EPS)
        value: Floats = cells.max(axis=0)
        unsettled = (partial.sum(axis=0) >= 2) & (value < 1 - EPS)
        for cell in np.flatnonzero(unsettled):
            parts = [self._in_box(k, int(cell)) for k in rows if self.cells[k, cell] > EPS]
            value[cell] = _union(parts).area / self.cell_area[cell]
        return value

    def per_tile(
        self, share: Floats, l0_x: npt.ArrayLike, l0_y: npt.ArrayLike, footprint: float
    ) -> npt.NDArray[np.float32]:
        """Per tile, the share of its area covered (``share`` as from `share` or `union`)."""
        areas = (share * self.cell_area).reshape(self.lattice.shape)
        return self.lattice.per_tile(areas, l0_x, l0_y, footprint)


def assign_labels(
    coverage: npt.NDArray[np.float32],
    names: list[str],
    areas: dict[str, float],
    min_coverage: float,
    priority: list[str],
    never: frozenset[str] = frozenset(),
) -> npt.NDArray[np.int32]:
    """Per tile, the column of the class that labels it, -1 when none does.

    A class labels a tile when it covers at least ``min_coverage`` of it. When several do
    (overlapping classes), the first in ``priority`` wins; classes not listed there come after,
    the smallest region on this slide first (the most specific annotation, e.g. a tumour
    outline drawn inside a tissue outline), then by name. Classes in ``never`` (exclusion
    regions) label nothing."""
    ranked = [n for n in priority if n in names]
    ranked += sorted((n for n in names if n not in ranked), key=lambda n: (areas.get(n, 0.0), n))
    labels = np.full(len(coverage), -1, dtype=np.int32)
    for name in reversed(ranked):  # the highest-ranked class is written last
        if name in never:
            continue
        column = names.index(name)
        labels[coverage[:, column] >= min_coverage] = column
    return labels
