"""QuPath GeoJSON annotations (a Digital Slide Archive document, also JSON, is handed to `_dsa`).

- **QuPath GeoJSON** (a FeatureCollection, a bare list of Features, or one Feature): the class
  is ``properties.classification.name`` (or the older plain ``properties.classification``
  string); Polygon (holes kept), MultiPolygon and GeometryCollection; objects without a class
  are ``Unclassified`` (QuPath's own name for them). A reader may keep only some QuPath
  object types (``objectType``: annotation, detection, cell, tile, tma_core); how many
  objects other than annotations were read or left out is noted.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import simdjson

from wsi_loader.errors import AnnotationError
from wsi_loader.index.annotations._dsa import dsa, dsa_bodies
from wsi_loader.index.annotations._shapes import (
    UNCLASSIFIED,
    Json,
    Parsed,
    Rings,
    Skipped,
    ring,
    shorten,
    tally,
)

MAX_CACHED_CLASSES = 10_000  # classification texts whose names are kept while a file is read
MAX_CLASS_DEPTH = 64  # parent classes of a QuPath derived class (a hostile file nests more)
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


# A string, or a bare non-finite number outside strings (group 1)
_NON_FINITE = re.compile(rb'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)')


def _non_finite_as_null(data: bytes) -> bytes:
    """The document with bare NaN / Infinity / -Infinity (not JSON, but what QuPath before
    0.5 and Python's json.dump write for non-finite measurements) turned into null; text
    inside strings is left alone. In coordinates, null is then refused as not a number."""
    return _NON_FINITE.sub(lambda m: b"null" if m.group(1) else m.group(0), data)


def geojson(data: bytes, path: str, wanted: frozenset[str] | None = None) -> Parsed:
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
    bodies = dsa_bodies(document)
    if bodies is not None:
        return dsa(bodies, path)
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
    rings, skipped, types = Rings(), Skipped(), _ObjectTypes(wanted)
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
                f"{tally(self.read)} QuPath objects were read as regions of their classes, "
                "like the annotations (--annotation-objects annotation reads annotations only)"
            )
        if self.left:
            notes.append(f"{tally(self.left)} QuPath objects were left out (annotation_objects)")
        return notes


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
    # JSON text. A missing key is costly on a simdjson Object (it raises and catches
    # inside), and a file of cell detections would pay it on every detection
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


def _geojson_polygons(
    geometry: Json, name: str, path: str, where: str, collected: Rings, skipped: Skipped
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
        shell, *holes = (ring(r, path, where) for r in rings)
        if len(shell) < 3:
            skipped.skip("polygons without an area")
            continue
        collected.add(name, shell, [h for h in holes if len(h) >= 3], where)
