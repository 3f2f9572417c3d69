"""Parse region annotation files into class-named level-0 polygons.

Three formats, all untrusted input (XML goes through ``defusedxml``: no entity expansion, no
external references):

- **QuPath GeoJSON** (a FeatureCollection, a bare list of Features, or one Feature): the class
  is ``properties.classification.name`` (or the older plain ``properties.classification``
  string); Polygon (holes kept), MultiPolygon and GeometryCollection; objects without a class
  are ``Unclassified`` (QuPath's own name for them).
- **ASAP XML** (Camelyon16/17): ``<Annotation PartOfGroup=...>`` with ``<Coordinate Order X Y>``.
  The group is the class, with Camelyon16's convention: groups ``_0`` and ``_1`` are ``Tumor``,
  and ``_2`` (or a group named ``Exclusion``) are non-tumour areas cut out of the file's other
  regions. ``None``/empty groups are ``Unclassified``.
- **Aperio ImageScope XML**: ``<Annotation Name=...><Regions><Region NegativeROA=...>
  <Vertices><Vertex X Y>``. The class is the layer's ``Name`` (else its first attribute's name,
  else ``Layer <Id>``); a region with ``NegativeROA="1"`` is a hole cut out of its own layer;
  ``Type="2"`` regions are ellipses given by two corner vertices.

Points, lines, arrows and rulers carry no area and are skipped (counted in the notes).
Self-intersecting polygons are repaired with ``shapely.make_valid`` (noted).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from xml.etree.ElementTree import Element, ParseError

import numpy as np
import orjson
import shapely
from defusedxml import DefusedXmlException
from defusedxml.ElementTree import parse as parse_xml
from shapely.geometry.base import BaseGeometry

from wsi_loader.errors import AnnotationError

UNCLASSIFIED = "Unclassified"
ANNOTATION_SUFFIXES = (".geojson", ".json", ".xml")
MAX_FILE_BYTES = 512 * 2**20  # a bigger "annotation" file is a mistake, not annotations
ELLIPSE_SEGMENTS = 64
ASAP_TUMOUR_GROUPS = frozenset({"_0", "_1"})
ASAP_EXCLUSION_GROUPS = frozenset({"_2", "exclusion"})


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


def read_annotations(path: str) -> Parsed:
    """The shapes of one annotation file, its format told by its contents (JSON or which XML
    root element). Raises `AnnotationError` naming the file and the element at fault."""
    try:
        size = os.stat(path).st_size
        if size > MAX_FILE_BYTES:
            raise AnnotationError(
                f"{size / 2**20:.0f} MiB is too large for an annotation file", path=path
            )
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise AnnotationError(f"cannot read: {exc.strerror or exc}", path=path) from exc
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        return _geojson(data, path)
    if head == b"<":
        return _xml(path)
    raise AnnotationError(
        "not an annotation file (neither JSON nor XML: expected QuPath GeoJSON, ASAP or Aperio "
        "XML)",
        path=path,
    )


# -- geometry helpers --------------------------------------------------------------------------
def _points(values: Iterable[Any], path: str, where: str) -> np.ndarray:
    try:
        array = np.asarray(list(values), dtype=np.float64)
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


class _Repairs:
    def __init__(self) -> None:
        self.repaired = 0
        self.skipped: dict[str, int] = {}

    def valid(self, geometry: BaseGeometry) -> BaseGeometry:
        if geometry.is_valid:
            return geometry
        self.repaired += 1
        return polygonal(shapely.make_valid(geometry))

    def skip(self, kind: str) -> None:
        self.skipped[kind] = self.skipped.get(kind, 0) + 1

    def notes(self) -> list[str]:
        notes = []
        if self.repaired:
            notes.append(
                f"{self.repaired} self-intersecting or otherwise invalid polygons were repaired "
                "(shapely make_valid)"
            )
        if self.skipped:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.skipped.items()))
            notes.append(f"regions without an area were skipped: {kinds}")
        return notes


def _flat(points: np.ndarray) -> bool:
    """True when the points enclose no area (all on one line, or one point): the centred
    points have rank < 2."""
    centred = points - points.mean(axis=0)
    singular = np.linalg.svd(centred, compute_uv=False)
    return bool(singular[-1] <= 1e-9 * max(float(singular[0]), 1.0))


def _ring_polygon(points: np.ndarray, repairs: _Repairs, what: str) -> BaseGeometry | None:
    """A polygon through the points, or None (counted) when they enclose no area."""
    if len(points) < 3 or _flat(points):
        repairs.skip(what)
        return None
    polygon = repairs.valid(shapely.Polygon(points))
    if polygon.is_empty or polygon.area == 0:
        repairs.skip(what)
        return None
    return polygon


# -- GeoJSON -----------------------------------------------------------------------------------
def _geojson(data: bytes, path: str) -> Parsed:
    try:
        document = orjson.loads(data)  # ~3x faster than json on coordinate arrays
    except (ValueError, RecursionError) as exc:
        raise AnnotationError(f"malformed JSON: {exc}", path=path) from None
    if isinstance(document, dict) and document.get("type") == "FeatureCollection":
        features = document.get("features")
        if not isinstance(features, list):
            raise AnnotationError("a FeatureCollection without a 'features' list", path=path)
    elif isinstance(document, dict) and document.get("type") == "Feature":
        features = [document]
    elif isinstance(document, list):
        features = document
    else:
        raise AnnotationError(
            "not GeoJSON annotations: expected a FeatureCollection, a Feature or a list of "
            "Features",
            path=path,
        )
    parsed, repairs = Parsed(), _Repairs()
    for i, feature in enumerate(features):
        where = f"feature {i}"
        if not isinstance(feature, dict) or feature.get("type") != "Feature":
            raise AnnotationError("not a GeoJSON Feature object", path=path, element=where)
        name = _qupath_class(feature.get("properties"), path, where)
        geometry = feature.get("geometry")
        if geometry is None:
            repairs.skip("features without geometry")
            continue
        for polygon in _geojson_polygons(geometry, path, where, repairs):
            parsed.shapes.append(Shape(name, polygon))
    parsed.notes = repairs.notes()
    return parsed


def _qupath_class(properties: Any, path: str, where: str) -> str:
    if properties is None:
        return UNCLASSIFIED
    if not isinstance(properties, dict):
        raise AnnotationError("'properties' is not an object", path=path, element=where)
    value = properties.get("classification")
    if isinstance(value, dict):
        value = value.get("name")
    if value is None or value == "":
        return UNCLASSIFIED
    if not isinstance(value, str):
        raise AnnotationError(f"classification {value!r} is not a name", path=path, element=where)
    return value


def _geojson_polygons(
    geometry: Any, path: str, where: str, repairs: _Repairs
) -> Iterator[BaseGeometry]:
    if not isinstance(geometry, dict) or not isinstance(geometry.get("type"), str):
        raise AnnotationError("'geometry' is not a GeoJSON geometry", path=path, element=where)
    kind = geometry["type"]
    if kind == "GeometryCollection":
        members = geometry.get("geometries")
        if not isinstance(members, list):
            raise AnnotationError(
                "a GeometryCollection without 'geometries'", path=path, element=where
            )
        for member in members:
            yield from _geojson_polygons(member, path, where, repairs)
        return
    if kind not in ("Polygon", "MultiPolygon"):
        repairs.skip(f"{kind} features")
        return
    coordinates = geometry.get("coordinates")
    polygons = coordinates if kind == "MultiPolygon" else [coordinates]
    if not isinstance(polygons, list):
        raise AnnotationError(f"{kind} without coordinates", path=path, element=where)
    for rings in polygons:
        if not isinstance(rings, list) or not rings:
            raise AnnotationError(f"{kind} with an empty polygon", path=path, element=where)
        shell, *holes = (_points(ring, path, where) for ring in rings)
        if len(shell) < 3 or _flat(shell):
            repairs.skip("polygons without an area")
            continue
        try:
            built = shapely.Polygon(shell, [h for h in holes if len(h) >= 3])
        except (ValueError, shapely.errors.GEOSException) as exc:
            raise AnnotationError(f"not a polygon: {exc}", path=path, element=where) from None
        polygon = repairs.valid(built)
        if not polygon.is_empty and polygon.area > 0:
            yield polygon


# -- XML (ASAP, Aperio) ------------------------------------------------------------------------
def _xml(path: str) -> Parsed:
    try:
        root = parse_xml(path, forbid_dtd=True).getroot()
    except DefusedXmlException as exc:
        raise AnnotationError(
            f"refused: the XML declares a DTD or entities ({type(exc).__name__})", path=path
        ) from None
    except ParseError as exc:
        raise AnnotationError(f"malformed XML: {exc}", path=path) from None
    if root is None:
        raise AnnotationError("an XML file without a root element", path=path)
    if root.tag == "ASAP_Annotations":
        return _asap(root, path)
    if root.tag == "Annotations" and (root.find("Annotation/Regions") is not None or not len(root)):
        return _aperio(root, path)
    raise AnnotationError(
        f"unknown XML annotations (root element <{root.tag}>): expected ASAP "
        "(<ASAP_Annotations>) or Aperio ImageScope (<Annotations><Annotation><Regions>)",
        path=path,
    )


def _number(element: Element, name: str, path: str, where: str) -> float:
    text = element.get(name)
    try:
        value = float(text.replace(",", ".")) if text is not None else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise AnnotationError(
            f"<{element.tag}> has no numeric {name} (got {text!r})", path=path, element=where
        )
    return value


def _asap(root: Element, path: str) -> Parsed:
    parsed, repairs = Parsed(), _Repairs()
    excluded: list[BaseGeometry] = []
    for i, annotation in enumerate(root.iter("Annotation")):
        label = annotation.get("Name") or str(i)
        where = f"Annotation {i} ({label!r})"
        kind = (annotation.get("Type") or "Polygon").lower()
        coordinates = annotation.findall("Coordinates/Coordinate")
        try:
            ordered = sorted(coordinates, key=lambda c: int(c.get("Order") or 0))
        except ValueError:
            raise AnnotationError(
                "a Coordinate Order is not a number", path=path, element=where
            ) from None
        points = [(_number(c, "X", path, where), _number(c, "Y", path, where)) for c in ordered]
        if kind in ("dot", "pointset", "measurement") or not points:
            repairs.skip(f"ASAP {kind} annotations")
            continue
        polygon = _ring_polygon(np.array(points), repairs, f"ASAP {kind} annotations")
        if polygon is None:
            continue
        group = (annotation.get("PartOfGroup") or "").strip()
        if group.lower() in ASAP_EXCLUSION_GROUPS:
            excluded.append(polygon)
            continue
        name = "Tumor" if group in ASAP_TUMOUR_GROUPS else group
        parsed.shapes.append(Shape(name if name and name != "None" else UNCLASSIFIED, polygon))
    for name in sorted({s.name for s in parsed.shapes}):
        parsed.shapes.extend(Shape(name, polygon, hole=True) for polygon in excluded)
    parsed.notes = repairs.notes()
    return parsed


def _aperio_name(annotation: Element, i: int) -> str:
    name = (annotation.get("Name") or "").strip()
    if name:
        return name
    for attribute in annotation.findall("Attributes/Attribute"):
        value = (attribute.get("Name") or "").strip()
        if value and value != "Description":
            return value
    return f"Layer {annotation.get('Id') or i + 1}"


def _aperio(root: Element, path: str) -> Parsed:
    parsed, repairs = Parsed(), _Repairs()
    for i, annotation in enumerate(root.findall("Annotation")):
        name = _aperio_name(annotation, i)
        for j, region in enumerate(annotation.findall("Regions/Region")):
            where = f"Annotation {name!r} Region {region.get('Id') or j}"
            points = np.array(
                [
                    (_number(v, "X", path, where), _number(v, "Y", path, where))
                    for v in region.findall("Vertices/Vertex")
                ]
            ).reshape(-1, 2)
            if region.get("Type") == "2" and len(points) >= 2:  # ellipse in a bounding box
                polygon = _ellipse(points)
            else:
                polygon = _ring_polygon(points, repairs, "Aperio regions with < 3 vertices")
            if polygon is None or polygon.is_empty:
                continue
            hole = (region.get("NegativeROA") or "0").strip() == "1"
            parsed.shapes.append(Shape(name, polygon, hole=hole))
    parsed.notes = repairs.notes()
    return parsed


def _ellipse(points: np.ndarray) -> BaseGeometry | None:
    (x0, y0), (x1, y1) = points.min(axis=0), points.max(axis=0)
    if x1 <= x0 or y1 <= y0:
        return None
    angle = np.linspace(0, 2 * np.pi, ELLIPSE_SEGMENTS, endpoint=False)
    cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
    return shapely.Polygon(np.column_stack([cx + rx * np.cos(angle), cy + ry * np.sin(angle)]))
