"""What every annotation format shares: `Shape` and `Parsed`, coordinates checked as they are
read (JSON rings, XML vertices), polygons built, repaired and counted when skipped.

Points, lines, arrows and rulers carry no area and are skipped (counted in the notes).
Self-intersecting polygons are repaired with ``shapely.make_valid`` (noted; the polygon keeps
everything its outline encloses) by `repair`, a
separate vectorised step, so that a caller can check validity while it does other work.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from xml.etree.ElementTree import Element

import numpy as np
import numpy.typing as npt
import shapely
import simdjson
from shapely.geometry.base import BaseGeometry

from wsi_loader.errors import AnnotationError

UNCLASSIFIED = "Unclassified"
ELLIPSE_SEGMENTS = 64


@dataclass
class Shape:
    """One polygonal region: its class, its geometry (level-0 pixels) and whether it is a hole
    cut out of its class (``hole``) rather than a part of it."""

    name: str
    geometry: BaseGeometry
    hole: bool = False


@dataclass
class Parsed:
    shapes: list[Shape] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def shorten(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to about ``limit`` characters (a value in a message)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- geometry helpers --------------------------------------------------------------------------
def points(values: Iterable[Any], path: str, where: str) -> np.ndarray:
    listed = list(values)
    for point in listed:  # numpy would take True for 1 and "10" for 10
        odd = [v for v in point if type(v) not in (int, float, list)] if type(point) is list else []
        if odd:
            raise AnnotationError(
                f"coordinates are not numbers (got {shorten(odd[0])})", path=path, element=where
            )
    try:
        array = np.asarray(listed, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise AnnotationError(
            f"coordinates are not numbers ({exc})", path=path, element=where
        ) from None
    if array.ndim != 2 or array.shape[1] < 2 or not len(array):
        raise AnnotationError(
            "coordinates are not a list of [x, y] points", path=path, element=where
        )
    if not np.isfinite(array).all():
        raise AnnotationError("coordinates are not finite numbers", path=path, element=where)
    return array[:, :2]


def polygonal(geometry: BaseGeometry) -> BaseGeometry:
    """The polygonal part of a geometry (make_valid and rectangle clipping may add lines or
    points). Their polygons do not overlap, so no union is needed."""
    polygons = [
        p
        for part in shapely.get_parts(geometry)
        if part.geom_type in ("Polygon", "MultiPolygon")
        for p in shapely.get_parts(part)
        if not p.is_empty
    ]
    if not polygons:
        return shapely.Polygon()
    if len(polygons) == 1:
        single: BaseGeometry = polygons[0]
        return single
    many: BaseGeometry = shapely.multipolygons(polygons)
    return many


class Skipped:
    """Regions without an area, counted by kind for the notes."""

    def __init__(self) -> None:
        self.kinds: dict[str, int] = {}

    def skip(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def notes(self) -> list[str]:
        if not self.kinds:
            return []
        return [f"regions without an area were skipped: {tally(self.kinds)}"]


def repair(shapes: list[Shape], valid: npt.NDArray[np.bool_] | None = None) -> Parsed:
    """The shapes with invalid polygons (self-intersections, ...) repaired by make_valid, and a
    note of how many; ``valid`` is `shapely.is_valid` of the shapes when already known."""
    if valid is None:
        valid = shapely.is_valid(np.asarray([s.geometry for s in shapes], dtype=object))
    if valid.all():
        return Parsed(shapes=list(shapes))
    fixed, lost = [], 0
    for shape, ok in zip(shapes, valid.tolist(), strict=True):
        # "structure": keeps everything the outline encloses. The default "linework" method
        # alternates lobes in and out, and is slow on an outline crossing itself thousands of
        # times (a hostile input of a few KB: benchmarks/README.md, "Annotation parsing")
        geometry = (
            shape.geometry
            if ok
            else polygonal(shapely.make_valid(shape.geometry, method="structure"))
        )
        if geometry.is_empty or geometry.area == 0:
            lost += 1
            continue
        fixed.append(Shape(shape.name, geometry, shape.hole))
    repaired = len(valid) - int(valid.sum())
    note = (
        f"{repaired} self-intersecting or otherwise invalid polygons were repaired "
        "(shapely make_valid)"
    )
    if lost:
        note += f"; {lost} of them enclose no area and were skipped"
    return Parsed(shapes=fixed, notes=[note])


def _flat(points: np.ndarray) -> bool:
    """True when the points enclose no area (all on one line, or one point): the smaller
    singular value of the centred points is ~0 against the larger. From the 2 x 2 scatter
    matrix with plain numpy sums: an SVD calls LAPACK, whose OpenBLAS threads then spin for
    ~0.1 s on the core another thread (tissue detection, another worker) needs."""
    centred = points - points.mean(axis=0)
    xx = float((centred[:, 0] * centred[:, 0]).sum())
    yy = float((centred[:, 1] * centred[:, 1]).sum())
    xy = float((centred[:, 0] * centred[:, 1]).sum())
    trace, det = xx + yy, max(xx * yy - xy * xy, 0.0)
    big = (trace + math.sqrt(max(trace * trace - 4 * det, 0.0))) / 2  # eigenvalues of the
    small = det / big if big > 0 else 0.0  # scatter matrix: the squared singular values
    return bool(math.sqrt(small) <= 1e-9 * max(math.sqrt(big), 1.0))


def ring_polygon(points: np.ndarray, skipped: Skipped, what: str) -> BaseGeometry | None:
    """A polygon through the points, or None (counted) when they enclose no area."""
    polygon = shapely.Polygon(points) if len(points) >= 3 else None
    if polygon is None or (polygon.area == 0 and _flat(points)):
        skipped.skip(what)
        return None
    return polygon


def tally(counts: dict[str, int]) -> str:
    """``{"cell": 3, "tile": 1}`` -> "3 cell, 1 tile"."""
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


class Rings:
    """Polygons as read, built into shapely geometries all at once: one vectorised call for
    those without holes (~20 us each otherwise; QuPath exports of cell detections have
    100,000s)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.shells: list[np.ndarray] = []
        self.holes: list[list[np.ndarray]] = []
        self.where: list[str] = []

    def add(self, name: str, shell: np.ndarray, holes: list[np.ndarray], where: str) -> None:
        self.names.append(name)
        self.shells.append(shell)
        self.holes.append(holes)
        self.where.append(where)

    def shapes(self, path: str, skipped: Skipped) -> list[Shape]:
        polygons = np.empty(len(self.shells), dtype=object)
        plain = [i for i, h in enumerate(self.holes) if not h]
        if plain:
            coords = np.concatenate([self.shells[i] for i in plain])
            ring = np.repeat(np.arange(len(plain)), [len(self.shells[i]) for i in plain])
            polygons[plain] = shapely.polygons(shapely.linearrings(coords, indices=ring))
        for i in (i for i, h in enumerate(self.holes) if h):
            try:
                polygons[i] = shapely.Polygon(self.shells[i], self.holes[i])
            except (ValueError, shapely.errors.GEOSException) as exc:
                raise AnnotationError(
                    f"not a polygon: {exc}", path=path, element=self.where[i]
                ) from None
        shapes = []
        flat = shapely.area(polygons) == 0  # (a bow tie has area 0 too, but is repaired)
        for i, polygon in enumerate(polygons):
            if flat[i] and _flat(self.shells[i]):
                skipped.skip("polygons without an area")
                continue
            shapes.append(Shape(self.names[i], polygon))
        return shapes


# -- coordinates of the JSON formats -----------------------------------------------------------
# simdjson hands each ring's numbers over as one buffer: faster than orjson plus numpy on
# coordinate arrays (benchmarks/README.md, "Annotation parsing"), and it builds no Python
# object per point, so no garbage collector runs make the time vary.
Json = simdjson.Object | simdjson.Array | str | int | float | bool | None


def ring(ring: Json, path: str, where: str) -> np.ndarray:
    """A GeoJSON ring ([[x, y], ...], or [x, y, z] points) as an (n, 2) array."""
    if not isinstance(ring, simdjson.Array):
        raise AnnotationError(
            "coordinates are not a list of [x, y] points", path=path, element=where
        )
    per_point = _point_like(ring[0]) if len(ring) else 0
    if per_point and _point_like(ring[-1]) == per_point:
        # the fast path: one buffer of numbers. as_buffer refuses anything but numbers (true,
        # null, strings) and JSON has no NaN or infinity, so only the shape is left to check:
        # it flattens, so the count is checked; a ragged middle that keeps the count is the
        # one malformation it can miss. The buffer owns its memory (not the parser's).
        try:
            values = np.frombuffer(ring.as_buffer(of_type="d"), dtype=np.float64)
        except (TypeError, ValueError):
            values = np.empty(0)
        if len(values) == per_point * len(ring):
            return values.reshape(-1, per_point)[:, :2]
    try:  # the slow path names what is wrong
        listed = ring.as_list()
    except ValueError as exc:
        raise AnnotationError(
            f"coordinates are not numbers ({exc})", path=path, element=where
        ) from None
    return points(listed, path, where)


def _point_like(value: Json) -> int:
    """2 or 3 for a list that looks like an [x, y] or [x, y, z] point, else 0 (whether its
    members are numbers is left to ``as_buffer``, which checks all of them at C speed)."""
    if not isinstance(value, simdjson.Array):
        return 0
    size = len(value)
    return size if size in (2, 3) else 0


# -- coordinates of the XML formats ------------------------------------------------------------
def _number(element: Element, name: str, path: str, where: str) -> float:
    text = element.get(name)
    try:
        value = float(text.replace(",", ".")) if text is not None else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise AnnotationError(
            f"<{element.tag}> has no numeric {name} (got {shorten(text)})", path=path, element=where
        )
    return value


def points_of(elements: list[Element], path: str, where: str) -> np.ndarray:
    """The X, Y attributes of the elements as an (n, 2) array, in one numpy conversion (it
    reads numbers as float() does); decimal commas, or a value that is not a finite number,
    take `_number` per value, which reads the one and names the element of the other."""
    texts = [(e.get("X"), e.get("Y")) for e in elements]
    try:
        points = np.array(texts, dtype=np.float64).reshape(-1, 2)
    except (TypeError, ValueError):
        points = None
    if points is not None and np.isfinite(points).all():
        return points
    numbers = [(_number(e, "X", path, where), _number(e, "Y", path, where)) for e in elements]
    return np.array(numbers, dtype=np.float64).reshape(-1, 2)
