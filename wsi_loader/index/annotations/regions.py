"""One slide's regions: every class's shapes merged into one level-0 geometry.

A class's geometry is the union of its shapes minus the union of its holes (Aperio negative
regions, ASAP exclusion groups; GeoJSON holes are inside their polygons already). Overlapping
shapes of one class count once. Shapes reaching outside the slide are clipped to it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import shapely
from shapely.geometry.base import BaseGeometry

from wsi_loader.index.annotations.formats import Shape, read_annotations


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


def read_regions(files: Sequence[str], width: int | None, height: int | None) -> SlideRegions:
    """Parse and merge the annotation files of one slide; with the slide's size, clip to it."""
    shapes: list[Shape] = []
    notes: list[str] = []
    for path in files:
        parsed = read_annotations(path)
        shapes.extend(parsed.shapes)
        notes.extend(f"{path}: {note}" for note in parsed.notes)
    classes: dict[str, BaseGeometry] = {}
    for name in sorted({s.name for s in shapes}):
        body = shapely.union_all([s.geometry for s in shapes if s.name == name and not s.hole])
        holes = [s.geometry for s in shapes if s.name == name and s.hole]
        if holes:
            body = shapely.difference(body, shapely.union_all(holes))
        if not body.is_empty:
            classes[name] = body
    if width is not None and height is not None:
        bounds = shapely.box(0, 0, width, height)
        outside = [n for n, g in classes.items() if not bounds.contains(g)]
        if outside:
            lost = sum(classes[n].area - classes[n].intersection(bounds).area for n in outside)
            notes.append(
                f"regions of {', '.join(repr(n) for n in outside)} reach outside the "
                f"{width} x {height} slide and were clipped to it ({lost:.0f} px^2 cut off)"
            )
            for name in outside:
                clipped = shapely.intersection(classes[name], bounds)
                if clipped.is_empty or clipped.area == 0:
                    notes.append(f"class {name!r} lies entirely outside the slide")
                    del classes[name]
                else:
                    classes[name] = clipped
    return SlideRegions(classes=classes, files=tuple(files), notes=notes)
