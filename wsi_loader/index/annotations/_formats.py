"""Parse region annotation files into class-named level-0 polygons.

Five formats, all untrusted input (XML goes through ``defusedxml``: no entity expansion, no
external references):

- **QuPath GeoJSON** (a FeatureCollection, a bare list of Features, or one Feature): the class
  is ``properties.classification.name`` (or the older plain ``properties.classification``
  string); Polygon (holes kept), MultiPolygon and GeometryCollection; objects without a class
  are ``Unclassified`` (QuPath's own name for them). A reader may keep only some QuPath
  object types (``objectType``: annotation, detection, cell, tile, tma_core); how many
  objects other than annotations were read or left out is noted.
- **ASAP XML** (Camelyon16/17): ``<Annotation PartOfGroup=...>`` with ``<Coordinate Order X Y>``.
  The group is the class, with Camelyon16's convention: groups ``_0`` and ``_1`` are ``Tumor``,
  and ``_2`` (or a group named ``Exclusion``) are non-tumour areas cut out of the file's other
  regions. ``None``/empty groups are ``Unclassified``.
- **Aperio ImageScope XML**: ``<Annotation Name=...><Regions><Region NegativeROA=...>
  <Vertices><Vertex X Y>``. The class is the layer's ``Name`` (else its first attribute's name,
  else ``Layer <Id>``); a region with ``NegativeROA="1"`` is a hole cut out of its own layer;
  ``Type="2"`` regions are ellipses given by two corner vertices.
- **HALO ``.annotations``** (Indica Labs): Aperio's layout with ``<V X Y>`` vertices; region
  ``Type`` ``Polygon``, ``Rectangle`` and ``Ellipse`` (both by two opposite corners).
- **Digital Slide Archive JSON** (HistomicsUI, large_image): an annotation (``{"name",
  "elements"}``), a record as its API returns one (``{"annotation": ...}``) or a list of them;
  closed ``polyline`` elements (with ``holes``), ``rectangle``, ``ellipse`` (centre, size,
  rotation in radians) and ``circle``; the class is an element's ``group``, else its label,
  else its annotation's name.

Points, lines, arrows and rulers carry no area and are skipped (counted in the notes).
Self-intersecting polygons are repaired with ``shapely.make_valid`` (noted; the polygon keeps
everything its outline encloses) by `repair`, a
separate vectorised step, so that a caller can check validity while it does other work.
"""

from __future__ import annotations

import codecs
import math
import os
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any
from xml.etree.ElementTree import Element, ParseError

import numpy as np
import numpy.typing as npt
import shapely
import simdjson
from defusedxml import DefusedXmlException
from defusedxml.ElementTree import fromstring as xml_from_bytes
from shapely.geometry.base import BaseGeometry

from wsi_loader.errors import AnnotationError

UNCLASSIFIED = "Unclassified"
ANNOTATION_SUFFIXES = (".geojson", ".json", ".xml", ".annotations")  # the last: HALO's
MAX_FILE_BYTES = 512 * 2**20  # a bigger "annotation" file is a mistake, not annotations
ELLIPSE_SEGMENTS = 64
MAX_CACHED_CLASSES = 10_000  # classification texts whose names are kept while a file is read
MAX_CLASS_DEPTH = 64  # parent classes of a QuPath derived class (a hostile file nests more)
# Class names end up in notes, warnings, meta.json and the label ids of every output, and every
# class is a coverage column of every tile of the index: a 48 MB name filled stderr with 50 MB,
# 100,000 classes took 24 s and 1.96 GB. Real projects have tens of classes.
MAX_CLASS_NAME = 256  # characters
MAX_CLASSES = 1_000  # of one file, one slide, and of an index
ASAP_TUMOUR_GROUPS = frozenset({"_0", "_1"})
ASAP_EXCLUSION_GROUPS = frozenset({"_2", "exclusion"})
# QuPath's object types (``properties.objectType`` since QuPath 0.3; the feature's ``id`` in
# 0.2). Cells and tiles are detections, as in QuPath (getDetectionObjects returns them too).
QUPATH_OBJECT_TYPES = ("annotation", "detection", "cell", "tile", "tma_core")
_QUPATH_02_IDS = {
    "PathAnnotationObject": "annotation",
    "PathDetectionObject": "detection",
    "PathCellObject": "cell",
    "PathTileObject": "tile",
    "TMACoreObject": "tma_core",
}


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


def object_types(kinds: Collection[str]) -> frozenset[str]:
    """The QuPath object types that ``kinds`` select ("detection" takes cells and tiles too);
    a ValueError names an unknown one."""
    unknown = sorted(set(kinds) - set(QUPATH_OBJECT_TYPES))
    if unknown:
        raise ValueError(
            f"unknown QuPath object type(s) {unknown}: choose from {list(QUPATH_OBJECT_TYPES)}"
        )
    selected = set(kinds)
    if "detection" in selected:
        selected |= {"cell", "tile"}
    return frozenset(selected)


def read_annotations(path: str, objects: Collection[str] = ()) -> Parsed:
    """The shapes of one annotation file, its format told by its contents (JSON or which XML
    root element). Raises `AnnotationError` naming the file and the element at fault.

    ``objects``: the QuPath object types whose features count (`QUPATH_OBJECT_TYPES`; none
    named: all). Features without a type (other tools' GeoJSON) and the regions of the other
    formats always count."""
    wanted = object_types(objects) if objects else None
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
    data = _utf8(data, path)
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        return check_classes(_geojson(data, path, wanted), path)
    if head == b"<":
        return check_classes(_xml(data, path), path)
    raise AnnotationError(
        "not an annotation file (neither JSON nor XML: expected QuPath GeoJSON, or ASAP, Aperio "
        "or HALO XML)",
        path=path,
    )


def check_classes(parsed: Parsed, path: str) -> Parsed:
    """``parsed`` when its class names and their number are within `MAX_CLASS_NAME` and
    `MAX_CLASSES`; else an `AnnotationError` that says so (``path``: the file or files)."""
    names = {shape.name for shape in parsed.shapes}
    longest = max(names, key=len, default="")
    if len(longest) > MAX_CLASS_NAME:
        raise AnnotationError(
            f"a class name of {len(longest):,} characters ({shorten(longest)}): class names "
            f"are at most {MAX_CLASS_NAME} characters",
            path=path,
        )
    if len(names) > MAX_CLASSES:
        raise AnnotationError(
            f"{len(names):,} classes, more than the {MAX_CLASSES:,} an index holds (each "
            "class is a coverage column of every tile); class names are meant to be few "
            "(Tumor, Stroma...), not one per object",
            path=path,
        )
    return parsed


def shorten(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to about ``limit`` characters (a value in a message)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Windows tools (Notepad, PowerShell, .NET's XmlWriter) start text with a byte order mark, and
# some write UTF-16. UTF-32's marks first: UTF-32-LE's begins with UTF-16-LE's.
_BYTE_ORDER_MARKS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_XML_ENCODING = re.compile(r"""^(\s*<\?xml[^>]*?\bencoding\s*=\s*)(["'])[^"']*\2""")


def _utf8(data: bytes, path: str) -> bytes:
    """The file's text as UTF-8 without a byte order mark (an XML declaration's encoding
    rewritten to match); a file without a mark is left as it is (JSON is UTF-8, and XML
    without a mark says its encoding in its declaration)."""
    for mark, codec in _BYTE_ORDER_MARKS:
        if data.startswith(mark):
            try:
                text = data.decode(codec)
            except UnicodeDecodeError as exc:
                raise AnnotationError(
                    f"not {codec.removesuffix('-sig').upper()} text, although it starts with "
                    f"that byte order mark ({exc.reason} at byte {exc.start})",
                    path=path,
                ) from None
            return _XML_ENCODING.sub(r"\1\2UTF-8\2", text, count=1).encode("utf-8")
    return data


# -- geometry helpers --------------------------------------------------------------------------
def _points(values: Iterable[Any], path: str, where: str) -> np.ndarray:
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


class _Skipped:
    """Regions without an area, counted by kind for the notes."""

    def __init__(self) -> None:
        self.kinds: dict[str, int] = {}

    def skip(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def notes(self) -> list[str]:
        if not self.kinds:
            return []
        return [f"regions without an area were skipped: {_tally(self.kinds)}"]


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
        # alternates lobes in and out and took 2.2 s on a 126-vertex outline crossing itself
        # ~4,000 times (a 3 KB hostile input) against 35 ms
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


def _ring_polygon(points: np.ndarray, skipped: _Skipped, what: str) -> BaseGeometry | None:
    """A polygon through the points, or None (counted) when they enclose no area."""
    polygon = shapely.Polygon(points) if len(points) >= 3 else None
    if polygon is None or (polygon.area == 0 and _flat(points)):
        skipped.skip(what)
        return None
    return polygon


# -- GeoJSON -----------------------------------------------------------------------------------
# simdjson hands each ring's numbers over as one buffer: ~3x faster than orjson plus numpy on
# coordinate arrays, and it builds no Python object per point (which also spared the garbage
# collector runs that made orjson's time vary 7-35 ms on a 2 MB file).
Json = simdjson.Object | simdjson.Array | str | int | float | bool | None


# A string, or a bare non-finite number outside strings (group 1)
_NON_FINITE = re.compile(rb'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)')


def _non_finite_as_null(data: bytes) -> bytes:
    """The document with bare NaN / Infinity / -Infinity (not JSON, but what QuPath before
    0.5 and Python's json.dump write for non-finite measurements) turned into null; text
    inside strings is left alone. In coordinates, null is then refused as not a number."""
    return _NON_FINITE.sub(lambda m: b"null" if m.group(1) else m.group(0), data)


def _geojson(data: bytes, path: str, wanted: frozenset[str] | None = None) -> Parsed:
    parser = simdjson.Parser()  # one per document: a parser's values die with its next parse
    try:
        document = parser.parse(data)
    except (ValueError, RuntimeError) as exc:  # RuntimeError: nested too deep
        if b"NaN" not in data and b"Infinity" not in data:
            raise AnnotationError(f"malformed JSON: {exc}", path=path) from None
        try:
            document = parser.parse(_non_finite_as_null(data))
        except (ValueError, RuntimeError):
            raise AnnotationError(f"malformed JSON: {exc}", path=path) from None
    bodies = _dsa_bodies(document)
    if bodies is not None:
        return _dsa(bodies, path)
    features: simdjson.Array | list[simdjson.Object]
    if isinstance(document, simdjson.Object) and document.get("type") == "FeatureCollection":
        listed = document.get("features")
        if not isinstance(listed, simdjson.Array):
            raise AnnotationError("a FeatureCollection without a 'features' list", path=path)
        features = listed
    elif isinstance(document, simdjson.Object) and document.get("type") == "Feature":
        features = [document]
    elif isinstance(document, simdjson.Array):
        features = document
    else:
        raise AnnotationError(
            "not GeoJSON annotations: expected a FeatureCollection, a Feature or a list of "
            "Features (or Digital Slide Archive annotations, with 'elements')",
            path=path,
        )
    rings, skipped, types = _Rings(), _Skipped(), _ObjectTypes(wanted)
    class_names: dict[object, str] = {}
    nests = b'"childObjects"' in data or b'"children"' in data  # spares 2 lookups a feature
    typed = b'"objectType"' in data or b'Object"' in data  # QuPath 0.3+, or 0.2's ids
    for i, top in enumerate(features):
        # QuPath nests child objects in properties.childObjects (or "children") when a script
        # exports the hierarchy: a stack, so that deep nesting cannot exhaust Python's
        stack: list[tuple[str, Json]] = [(f"feature {i}", top)]
        while stack:
            where, feature = stack.pop()
            if not isinstance(feature, simdjson.Object) or feature.get("type") != "Feature":
                raise AnnotationError("not a GeoJSON Feature object", path=path, element=where)
            properties = feature.get("properties")
            if nests and isinstance(properties, simdjson.Object):
                children = properties.get("childObjects") or properties.get("children")
                if isinstance(children, simdjson.Array):
                    nested = [(f"{where} child {j}", c) for j, c in enumerate(children)]
                    stack.extend(reversed(nested))  # popped in file order
            if typed and not types.counts(_object_type(feature, properties)):
                continue
            name = _qupath_class(properties, path, where, class_names)
            geometry = feature.get("geometry")
            if geometry is None:
                skipped.skip("features without geometry")
                continue
            _geojson_polygons(geometry, name, path, where, rings, skipped)
    return Parsed(shapes=rings.shapes(path, skipped), notes=skipped.notes() + types.notes())


def _object_type(feature: simdjson.Object, properties: Json) -> str | None:
    """The feature's QuPath object type, None when it has none (not a QuPath export)."""
    kind = properties.get("objectType") if isinstance(properties, simdjson.Object) else None
    if isinstance(kind, str):
        return kind
    old = feature.get("id")  # QuPath 0.2; a UUID since 0.4
    return _QUPATH_02_IDS.get(old) if isinstance(old, str) else None


class _ObjectTypes:
    """Which QuPath objects count (``wanted``; None: all), and how many of each type other
    than annotations were counted or left out, for the notes: a user who exported "all
    objects" learns that cell detections became regions of their classes."""

    def __init__(self, wanted: frozenset[str] | None) -> None:
        self.wanted = wanted
        self.read: dict[str, int] = {}  # with every type wanted: those other than annotations
        self.left: dict[str, int] = {}  # with some types wanted: those left out

    def counts(self, kind: str | None) -> bool:
        if kind is None:
            return True
        if self.wanted is None:
            if kind != "annotation":
                self.read[kind] = self.read.get(kind, 0) + 1
            return True
        if kind in self.wanted:
            return True
        self.left[kind] = self.left.get(kind, 0) + 1
        return False

    def notes(self) -> list[str]:
        notes = []
        if self.read:
            notes.append(
                f"{_tally(self.read)} QuPath objects were read as regions of their classes, "
                "like the annotations (--annotation-objects annotation reads annotations only)"
            )
        if self.left:
            notes.append(f"{_tally(self.left)} QuPath objects were left out (annotation_objects)")
        return notes


def _tally(counts: dict[str, int]) -> str:
    """``{"cell": 3, "tile": 1}`` -> "3 cell, 1 tile"."""
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


class _Rings:
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

    def shapes(self, path: str, skipped: _Skipped) -> list[Shape]:
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


def _qupath_class(properties: Json, path: str, where: str, names: dict[object, str]) -> str:
    """The feature's class name; ``names`` caches names by classification text."""
    if properties is None:
        return UNCLASSIFIED
    if not isinstance(properties, simdjson.Object):
        raise AnnotationError("'properties' is not an object", path=path, element=where)
    value = properties.get("classification")
    if not isinstance(value, simdjson.Object | simdjson.Array):
        return _class_name(value, path, where) or UNCLASSIFIED
    # the same few classifications repeat on every detection: their names are kept by their
    # JSON text. A missing key costs ~2 us on a simdjson Object (it raises and catches
    # inside): three such lookups were 40% of reading a file of 20,000 cell detections
    text: object = value.mini  # bytes (the stubs say str)
    name = names.get(text)
    if name is None:
        plain = value.as_dict() if isinstance(value, simdjson.Object) else value.as_list()
        name = _class_name(plain, path, where) or UNCLASSIFIED
        if len(names) < MAX_CACHED_CLASSES:
            names[text] = name
    return name


def _class_name(value: object, path: str, where: str, depth: int = 0) -> str:
    """A QuPath classification's full name ("" for none): a string (QuPath 0.1/0.2 scripts),
    {"name": ...}, or a derived class such as "Tumor: Positive", written since QuPath 0.4 as
    {"names": ["Tumor", "Positive"]} and before as {"parentClass": {...}, "name": "Positive"}
    (Gson's default). ``value`` is plain Python (dicts and lists)."""
    if isinstance(value, dict):
        names = value.get("names")
        if value.get("name") is None and isinstance(names, list):
            parts = [n for n in names if isinstance(n, str) and n]
            if len(parts) != len(names):
                raise AnnotationError(
                    f"classification {shorten(names)} is not a name", path=path, element=where
                )
            return ": ".join(parts)
        if depth > MAX_CLASS_DEPTH:
            raise AnnotationError("classification nested too deep", path=path, element=where)
        parent = _class_name(value.get("parentClass"), path, where, depth + 1)
        own = _class_name(value.get("name"), path, where, depth + 1)
        return f"{parent}: {own}" if parent and own else own
    if value is None or isinstance(value, str):
        return value or ""
    raise AnnotationError(
        f"classification {shorten(value)} is not a name", path=path, element=where
    )


def _ring(ring: Json, path: str, where: str) -> np.ndarray:
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
    return _points(listed, path, where)


def _point_like(value: Json) -> int:
    """2 or 3 for a list that looks like an [x, y] or [x, y, z] point, else 0 (whether its
    members are numbers is left to ``as_buffer``, which checks all of them at C speed)."""
    if not isinstance(value, simdjson.Array):
        return 0
    size = len(value)
    return size if size in (2, 3) else 0


def _geojson_polygons(
    geometry: Json, name: str, path: str, where: str, collected: _Rings, skipped: _Skipped
) -> None:
    """Add the geometry's polygons (Polygon, MultiPolygon, GeometryCollection) to
    ``collected``; count what has no area."""
    if not isinstance(geometry, simdjson.Object) or not isinstance(geometry.get("type"), str):
        raise AnnotationError("'geometry' is not a GeoJSON geometry", path=path, element=where)
    kind = geometry["type"]
    if kind == "GeometryCollection":
        members = geometry.get("geometries")
        if not isinstance(members, simdjson.Array):
            raise AnnotationError(
                "a GeometryCollection without 'geometries'", path=path, element=where
            )
        for member in members:
            _geojson_polygons(member, name, path, where, collected, skipped)
        return
    if kind not in ("Polygon", "MultiPolygon"):
        skipped.skip(f"{kind} features")
        return
    coordinates = geometry.get("coordinates")
    if not isinstance(coordinates, simdjson.Array):
        raise AnnotationError(f"{kind} without coordinates", path=path, element=where)
    polygons = coordinates if kind == "MultiPolygon" else [coordinates]
    for rings in polygons:
        if not isinstance(rings, simdjson.Array) or not len(rings):
            raise AnnotationError(f"{kind} with an empty polygon", path=path, element=where)
        shell, *holes = (_ring(ring, path, where) for ring in rings)
        if len(shell) < 3:
            skipped.skip("polygons without an area")
            continue
        collected.add(name, shell, [h for h in holes if len(h) >= 3], where)


# -- Digital Slide Archive (HistomicsUI, large_image) JSON ------------------------------------
_DSA_SHAPES = ("rectangle", "ellipse", "circle")  # polylines aside


def _dsa_bodies(document: Json) -> list[simdjson.Object] | None:
    """The annotation bodies (``{"name", "elements"}``) of a DSA document, or None when it is
    not one: a body, a record as the API returns one (``{"annotation": body, ...}``), or a
    list of records or bodies (an item's annotations)."""

    def body(value: Json) -> simdjson.Object | None:
        if not isinstance(value, simdjson.Object):
            return None
        inner = value.get("annotation")
        if isinstance(inner, simdjson.Object) and isinstance(inner.get("elements"), simdjson.Array):
            return inner
        return value if isinstance(value.get("elements"), simdjson.Array) else None

    if isinstance(document, simdjson.Array):
        bodies = [body(value) for value in document]
        found = [b for b in bodies if b is not None]
        return found if found and len(found) == len(bodies) else None
    single = body(document)
    return None if single is None else [single]


def _dsa(bodies: list[simdjson.Object], path: str) -> Parsed:
    """Closed polylines (with holes), rectangles, ellipses and circles; points, arrows, open
    polylines and the raster kinds (heatmaps, grids, images) have no outline and are counted.
    The class is an element's ``group`` (HistomicsUI's style group), else its label, else the
    name of its annotation."""
    rings, skipped = _Rings(), _Skipped()
    for i, body in enumerate(bodies):
        title = body.get("name")
        title = title.strip() if isinstance(title, str) else ""
        elements = body.get("elements")
        assert isinstance(elements, simdjson.Array)  # (what made it a body)
        for j, element in enumerate(elements):
            where = f"annotation {i}{f' ({shorten(title)})' if title else ''} element {j}"
            if not isinstance(element, simdjson.Object):
                raise AnnotationError("an element is not an object", path=path, element=where)
            kind = element.get("type")
            name = _dsa_class(element, title)
            if kind == "polyline" and element.get("closed") is True:
                shell = _ring(element.get("points"), path, where)
                listed = element.get("holes")
                if listed is not None and not isinstance(listed, simdjson.Array):
                    raise AnnotationError("'holes' is not a list", path=path, element=where)
                holes = [_ring(h, path, where) for h in listed or []]
                if len(shell) < 3:
                    skipped.skip("polygons without an area")
                    continue
                rings.add(name, shell, [h for h in holes if len(h) >= 3], where)
            elif kind == "polyline":
                skipped.skip("open DSA polylines")
            elif kind in _DSA_SHAPES:
                outline = _dsa_outline(element, str(kind), path, where)
                if outline is None:
                    skipped.skip("polygons without an area")
                    continue
                rings.add(name, outline, [], where)
            else:
                skipped.skip(f"DSA {kind} elements" if isinstance(kind, str) else "DSA elements")
    return Parsed(shapes=rings.shapes(path, skipped), notes=skipped.notes())


def _dsa_class(element: simdjson.Object, title: str) -> str:
    group = element.get("group")
    if isinstance(group, str) and group.strip():
        return group.strip()
    label = element.get("label")
    value = label.get("value") if isinstance(label, simdjson.Object) else None
    if isinstance(value, str) and value.strip():
        return value.strip()
    return title or UNCLASSIFIED


def _dsa_number(element: simdjson.Object, key: str, path: str, where: str) -> float:
    value = element.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AnnotationError(f"{key!r} is not a number", path=path, element=where)
    return float(value)


def _dsa_outline(element: simdjson.Object, kind: str, path: str, where: str) -> np.ndarray | None:
    """A rectangle's, ellipse's or circle's outline: ``center``, ``width`` and ``height`` (or
    ``radius``), turned by ``rotation`` radians (image axes: x right, y down); None when it
    has no area."""
    centre = element.get("center")
    if not isinstance(centre, simdjson.Array):
        raise AnnotationError("'center' is not an [x, y, z] point", path=path, element=where)
    cx, cy = _points([centre.as_list()], path, where)[0]
    if kind == "circle":
        rx = ry = _dsa_number(element, "radius", path, where)
        turn = 0.0
    else:
        rx = _dsa_number(element, "width", path, where) / 2
        ry = _dsa_number(element, "height", path, where) / 2
        turn = _dsa_number(element, "rotation", path, where)
    if not (rx > 0 and ry > 0):
        return None
    if kind == "rectangle":
        x, y = np.array([-rx, rx, rx, -rx]), np.array([-ry, -ry, ry, ry])
    else:
        angle = np.linspace(0, 2 * np.pi, ELLIPSE_SEGMENTS, endpoint=False)
        x, y = rx * np.cos(angle), ry * np.sin(angle)
    cos, sin = math.cos(turn), math.sin(turn)
    return np.column_stack([cx + x * cos - y * sin, cy + x * sin + y * cos])


# -- XML (ASAP, Aperio) ------------------------------------------------------------------------
def _xml(data: bytes, path: str) -> Parsed:
    try:
        root = xml_from_bytes(data, forbid_dtd=True)
    except DefusedXmlException as exc:
        raise AnnotationError(
            f"refused: the XML declares a DTD or entities ({type(exc).__name__})", path=path
        ) from None
    except ParseError as exc:
        raise AnnotationError(f"malformed XML: {exc}", path=path) from None
    if root.tag == "ASAP_Annotations":
        return _asap(root, path)
    if root.tag == "Annotations" and (root.find("Annotation/Regions") is not None or not len(root)):
        return _aperio(root, path)
    raise AnnotationError(
        f"unknown XML annotations (root element <{root.tag}>): expected ASAP "
        "(<ASAP_Annotations>) or Aperio ImageScope / HALO (<Annotations><Annotation><Regions>)",
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
            f"<{element.tag}> has no numeric {name} (got {shorten(text)})", path=path, element=where
        )
    return value


def _points_of(elements: list[Element], path: str, where: str) -> np.ndarray:
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


def _asap(root: Element, path: str) -> Parsed:
    parsed, skipped = Parsed(), _Skipped()
    excluded: list[BaseGeometry] = []
    for i, annotation in enumerate(root.iter("Annotation")):
        label = annotation.get("Name") or str(i)
        where = f"Annotation {i} ({shorten(label)})"
        kind = (annotation.get("Type") or "Polygon").lower()
        coordinates = annotation.findall("Coordinates/Coordinate")
        try:
            order = np.array([int(c.get("Order") or 0) for c in coordinates], dtype=np.int64)
        except ValueError:
            raise AnnotationError(
                "a Coordinate Order is not a number", path=path, element=where
            ) from None
        ordered = [coordinates[k] for k in np.argsort(order, kind="stable").tolist()]
        points = _points_of(ordered, path, where)
        if kind in ("dot", "pointset", "measurement") or not len(points):
            skipped.skip(f"ASAP {kind} annotations")
            continue
        polygon = _ring_polygon(points, skipped, f"ASAP {kind} annotations")
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
    parsed.notes = skipped.notes()
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
    """Aperio ImageScope XML, and HALO's ``.annotations`` (the same layout, with ``<V>``
    vertices and named region types)."""
    parsed, skipped = Parsed(), _Skipped()
    for i, annotation in enumerate(root.findall("Annotation")):
        name = _aperio_name(annotation, i)
        for j, region in enumerate(annotation.findall("Regions/Region")):
            where = f"Annotation {shorten(name)} Region {region.get('Id') or j}"
            vertices = region.findall("Vertices/Vertex") or region.findall("Vertices/V")
            points = _points_of(vertices, path, where).reshape(-1, 2)
            kind = (region.get("Type") or "").strip()
            if kind in ("Ruler", "Pin"):  # HALO's
                skipped.skip("HALO rulers and pins")
                continue
            if kind in ("2", "Ellipse") and len(points) >= 2:  # in its bounding box
                polygon = _ellipse(points)
            elif kind == "Rectangle" and len(points) == 2:  # HALO's: two opposite corners
                polygon = _box(points)
            else:
                polygon = _ring_polygon(points, skipped, "Aperio regions with < 3 vertices")
            if polygon is None or polygon.is_empty:
                continue
            hole = (region.get("NegativeROA") or "0").strip() == "1"
            parsed.shapes.append(Shape(name, polygon, hole=hole))
    parsed.notes = skipped.notes()
    return parsed


def _box(points: np.ndarray) -> BaseGeometry | None:
    (x0, y0), (x1, y1) = points.min(axis=0), points.max(axis=0)
    return shapely.box(x0, y0, x1, y1) if x1 > x0 and y1 > y0 else None


def _ellipse(points: np.ndarray) -> BaseGeometry | None:
    (x0, y0), (x1, y1) = points.min(axis=0), points.max(axis=0)
    if x1 <= x0 or y1 <= y0:
        return None
    angle = np.linspace(0, 2 * np.pi, ELLIPSE_SEGMENTS, endpoint=False)
    cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
    return shapely.Polygon(np.column_stack([cx + rx * np.cos(angle), cy + ry * np.sin(angle)]))
