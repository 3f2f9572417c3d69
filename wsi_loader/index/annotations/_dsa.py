"""Digital Slide Archive JSON annotations (HistomicsUI, large_image).

- **Digital Slide Archive JSON** (HistomicsUI, large_image): an annotation (``{"name",
  "elements"}``), a record as its API returns one (``{"annotation": ...}``) or a list of them;
  closed ``polyline`` elements (with ``holes``), ``rectangle``, ``ellipse`` (centre, size,
  rotation in radians) and ``circle``; the class is an element's ``group``, else its label,
  else its annotation's name.
"""

from __future__ import annotations

import math

import numpy as np
import simdjson

from wsi_loader.errors import AnnotationError
from wsi_loader.index.annotations._shapes import (
    ELLIPSE_SEGMENTS,
    UNCLASSIFIED,
    Json,
    Parsed,
    Rings,
    Skipped,
    points,
    ring,
    shorten,
)

_DSA_SHAPES = ("rectangle", "ellipse", "circle")  # polylines aside


def dsa_bodies(document: Json) -> list[simdjson.Object] | None:
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


def dsa(bodies: list[simdjson.Object], path: str) -> Parsed:
    """Closed polylines (with holes), rectangles, ellipses and circles; points, arrows, open
    polylines and the raster kinds (heatmaps, grids, images) have no outline and are counted.
    The class is an element's ``group`` (HistomicsUI's style group), else its label, else the
    name of its annotation."""
    rings, skipped = Rings(), Skipped()
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
                shell = ring(element.get("points"), path, where)
                listed = element.get("holes")
                if listed is not None and not isinstance(listed, simdjson.Array):
                    raise AnnotationError("'holes' is not a list", path=path, element=where)
                holes = [ring(h, path, where) for h in listed or []]
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
    cx, cy = points([centre.as_list()], path, where)[0]
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
