"""One slide's regions: every class's shapes merged into one level-0 geometry.

A class's geometry is the union of its shapes minus the union of its holes (Aperio negative
regions, ASAP exclusion groups; GeoJSON holes are inside their polygons already). Overlapping
shapes of one class count once. Shapes reaching outside the slide are clipped to it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import shapely
from shapely.geometry.base import BaseGeometry

from wsi_loader.index.annotations._formats import check_classes, read_annotations
from wsi_loader.index.annotations._shapes import Parsed, Shape, polygonal, repair


@dataclass
class SlideRegions:
    """Class name -> geometry (sorted by name), the files they came from, and notes on what
    was repaired, clipped or skipped (logged as the slide's warnings)."""

    classes: dict[str, BaseGeometry] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    def areas(self) -> dict[str, float]:
        return {name: float(geometry.area) for name, geometry in self.classes.items()}


def files_digest(files: Sequence[str]) -> str:
    """A digest of the annotation files' contents: a slide is re-indexed when it changes."""
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as fh:
            digest.update(hashlib.sha256(fh.read()).digest())
    return digest.hexdigest()[:32]


def merge(polygons: Sequence[BaseGeometry]) -> BaseGeometry:
    """The union of polygons, computed only where their bounding boxes overlap: a class's
    regions are usually apart, and a union costs ~3 ms per 1,000-vertex polygon."""
    if len(polygons) < 2:
        return shapely.union_all(polygons)
    # imported here: scipy.sparse cost ~0.3-0.5 s of every CLI start-up, annotations or not
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    array = np.asarray(polygons, dtype=object)
    left, right = shapely.STRtree(array).query(array)
    pairs = coo_matrix((np.ones(len(left)), (left, right)), shape=(len(array), len(array)))
    _, group = connected_components(pairs, directed=False)  # groups of overlapping boxes
    parts = []
    for g in np.unique(group):
        members = array[group == g]
        parts.append(members[0] if len(members) == 1 else shapely.union_all(members))
    # components are apart: their polygons together form a valid MultiPolygon
    merged: BaseGeometry = shapely.multipolygons(
        [q for part in parts for q in shapely.get_parts(part)]
    )
    return merged


ReadShapes = tuple[list[Shape], list[str]]  # the shapes and the notes of what was skipped


def read_shapes(files: Sequence[str], objects: Sequence[str] = ()) -> ReadShapes:
    """Every shape of one slide's annotation files, not yet checked for validity (see
    `_shapes.repair`), and the notes of what was skipped (each naming its file).
    ``objects``: the QuPath object types read (`read_annotations`)."""
    shapes: list[Shape] = []
    notes: list[str] = []
    for path in files:
        parsed = read_annotations(path, objects)
        shapes.extend(parsed.shapes)
        notes.extend(f"{path}: {note}" for note in parsed.notes)
    if len(files) > 1:  # each file is within the limits; together they may not be
        check_classes(Parsed(shapes), ", ".join(files))
    return shapes, notes


def repaired_notes(files: Sequence[str], notes: list[str]) -> list[str]:
    """A repair note, naming the slide's annotation files."""
    return [f"{', '.join(files)}: {note}" for note in notes]


def outside_note(shapes: Sequence[Shape], width: int, height: int) -> tuple[list[str], str | None]:
    """The classes with shapes reaching outside the slide, and a note of what clipping to it
    cuts off (None when nothing reaches outside)."""
    bodies = [s for s in shapes if not s.hole]
    if not bodies:
        return [], None
    b = shapely.bounds(np.asarray([s.geometry for s in bodies], dtype=object))
    out = (b[:, 0] < 0) | (b[:, 1] < 0) | (b[:, 2] > width) | (b[:, 3] > height)
    if not out.any():
        return [], None
    names = sorted({bodies[i].name for i in np.flatnonzero(out)})
    slide = shapely.box(0, 0, width, height)
    lost = sum(
        bodies[i].geometry.area - shapely.intersection(bodies[i].geometry, slide).area
        for i in np.flatnonzero(out)
    )
    return names, (
        f"regions of {', '.join(repr(n) for n in names)} reach outside the "
        f"{width} x {height} slide and were clipped to it ({lost:.0f} px^2 cut off)"
    )


def read_regions(
    files: Sequence[str], width: int | None, height: int | None, objects: Sequence[str] = ()
) -> SlideRegions:
    """Parse and merge the annotation files of one slide; with the slide's size, clip to it.
    ``objects``: the QuPath object types read (`read_annotations`)."""
    shapes, notes = read_shapes(files, objects)
    fixed = repair(shapes)
    shapes = fixed.shapes
    notes += repaired_notes(files, fixed.notes)
    classes: dict[str, BaseGeometry] = {}
    for name in sorted({s.name for s in shapes}):
        body = merge([s.geometry for s in shapes if s.name == name and not s.hole])
        holes = [s.geometry for s in shapes if s.name == name and s.hole]
        if holes:
            body = shapely.difference(body, shapely.union_all(holes))
        if not body.is_empty:
            classes[name] = body
    if width is not None and height is not None:
        outside, note = outside_note(shapes, width, height)
        if note is not None:
            notes.append(note)
        for name in outside:
            if name not in classes:
                continue
            # an intersection: shapely.clip_by_rect may return invalid polygons
            clipped = polygonal(
                shapely.intersection(classes[name], shapely.box(0, 0, width, height))
            )
            if clipped.is_empty or clipped.area == 0:
                notes.append(f"class {name!r} lies entirely outside the slide")
                del classes[name]
            else:
                classes[name] = clipped
    return SlideRegions(classes=classes, files=tuple(files), notes=notes)
