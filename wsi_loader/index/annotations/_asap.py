"""ASAP XML annotations (Camelyon16/17).

- **ASAP XML** (Camelyon16/17): ``<Annotation PartOfGroup=...>`` with ``<Coordinate Order X Y>``.
  The group is the class, with Camelyon16's convention: groups ``_0`` and ``_1`` are ``Tumor``,
  and ``_2`` (or a group named ``Exclusion``) are non-tumour areas cut out of the file's other
  regions. ``None``/empty groups are ``Unclassified``.
"""

from __future__ import annotations

from xml.etree.ElementTree import Element

import numpy as np
from shapely.geometry.base import BaseGeometry

from wsi_loader.errors import AnnotationError
from wsi_loader.index.annotations._shapes import (
    UNCLASSIFIED,
    Parsed,
    Shape,
    Skipped,
    points_of,
    ring_polygon,
    shorten,
)

ASAP_TUMOUR_GROUPS = frozenset({"_0", "_1"})
ASAP_EXCLUSION_GROUPS = frozenset({"_2", "exclusion"})


def asap(root: Element, path: str) -> Parsed:
    parsed, skipped = Parsed(), Skipped()
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
        points = points_of(ordered, path, where)
        if kind in ("dot", "pointset", "measurement") or not len(points):
            skipped.skip(f"ASAP {kind} annotations")
            continue
        polygon = ring_polygon(points, skipped, f"ASAP {kind} annotations")
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
