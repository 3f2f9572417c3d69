"""Aperio ImageScope XML annotations, and HALO's ``.annotations`` (the same layout).

- **Aperio ImageScope XML**: ``<Annotation Name=...><Regions><Region NegativeROA=...>
  <Vertices><Vertex X Y>``. The class is the layer's ``Name`` (else its first attribute's name,
  else ``Layer <Id>``); a region with ``NegativeROA="1"`` is a hole cut out of its own layer;
  ``Type="2"`` regions are ellipses given by two corner vertices.
- **HALO ``.annotations``** (Indica Labs): Aperio's layout with ``<V X Y>`` vertices; region
  ``Type`` ``Polygon``, ``Rectangle`` and ``Ellipse`` (both by two opposite corners).
"""

from __future__ import annotations

from xml.etree.ElementTree import Element

import numpy as np
import shapely
from shapely.geometry.base import BaseGeometry

from wsi_loader.index.annotations._shapes import (
    ELLIPSE_SEGMENTS,
    Parsed,
    Shape,
    Skipped,
    points_of,
    ring_polygon,
    shorten,
)


def _aperio_name(annotation: Element, i: int) -> str:
    name = (annotation.get("Name") or "").strip()
    if name:
        return name
    for attribute in annotation.findall("Attributes/Attribute"):
        value = (attribute.get("Name") or "").strip()
        if value and value != "Description":
            return value
    return f"Layer {annotation.get('Id') or i + 1}"


def aperio(root: Element, path: str) -> Parsed:
    """Aperio ImageScope XML, and HALO's ``.annotations`` (the same layout, with ``<V>``
    vertices and named region types)."""
    parsed, skipped = Parsed(), Skipped()
    for i, annotation in enumerate(root.findall("Annotation")):
        name = _aperio_name(annotation, i)
        for j, region in enumerate(annotation.findall("Regions/Region")):
            where = f"Annotation {shorten(name)} Region {region.get('Id') or j}"
            vertices = region.findall("Vertices/Vertex") or region.findall("Vertices/V")
            points = points_of(vertices, path, where).reshape(-1, 2)
            kind = (region.get("Type") or "").strip()
            if kind in ("Ruler", "Pin"):  # HALO's
                skipped.skip("HALO rulers and pins")
                continue
            if kind in ("2", "Ellipse") and len(points) >= 2:  # in its bounding box
                polygon = _ellipse(points)
            elif kind == "Rectangle" and len(points) == 2:  # HALO's: two opposite corners
                polygon = _box(points)
            else:
                polygon = ring_polygon(points, skipped, "Aperio regions with < 3 vertices")
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
