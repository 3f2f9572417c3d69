"""Annotations applied to an index: per-slide coverage and filters, then labels for all.

`annotate_slide` runs where a slide is indexed (a worker): it reads the slide's files,
computes each kept tile's coverage by the slide's own classes, and applies ``roi`` and
``exclude``. `label_tiles` runs where the index is assembled: it puts every slide's coverage
into the columns of all classes and derives the tile labels, so a change of ``min_coverage``,
``class_priority`` or ``background_label`` relabels carried-over slides without reading them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import shapely

from wsi_loader.config import IndexConfig
from wsi_loader.index._labels import label_order
from wsi_loader.index.annotations._coverage import ClassCells, Lattice, assign_labels
from wsi_loader.index.annotations._regions import (
    ReadShapes,
    outside_note,
    read_shapes,
    repaired_notes,
)
from wsi_loader.index.annotations._shapes import Shape, repair


@dataclass
class SlideAnnotations:
    keep: npt.NDArray[np.bool_]  # per input tile: passes roi / exclude
    coverage: npt.NDArray[np.float32]  # (input tiles, classes of this slide)
    areas: dict[str, float] = field(default_factory=dict)  # class -> level-0 px^2
    notes: list[str] = field(default_factory=list)


def annotate_slide(
    files: Sequence[str],
    cfg: IndexConfig,
    size: tuple[int, int],
    l0_x: npt.NDArray[Any],
    l0_y: npt.NDArray[Any],
    footprint: float,
    parsed: ReadShapes | None = None,
) -> SlideAnnotations:
    """Coverage and filters for one slide's tiles (raises `AnnotationError` on a bad file);
    ``parsed``: `read_shapes` of ``files`` when already read."""
    shapes, notes = parsed if parsed is not None else read_shapes(files)
    notes = list(notes)
    cells, shapes, repair_notes = _measure(shapes, Lattice.for_tiles(l0_x, l0_y, footprint, size))
    notes += repaired_notes(files, repair_notes)
    outside, note = outside_note(shapes, *size)
    if note is not None:
        notes.append(note)
    areas = cells.areas()
    for name in outside:
        if areas[name] == 0:
            notes.append(f"class {name!r} lies entirely outside the slide")
    classes = [n for n in cells.names if areas[n] > 0]  # all cut away by holes: no class

    def tile_share(share: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
        return cells.per_tile(share, l0_x, l0_y, footprint)

    keep = np.ones(len(l0_x), dtype=bool)
    if cfg.roi:
        keep &= tile_share(cells.union(cfg.roi)) >= cfg.min_coverage
        if not files:
            notes.append("no annotation file, so no tile is inside the regions of interest")
    if cfg.exclude:
        keep &= tile_share(cells.union(cfg.exclude)) <= cfg.max_excluded
    coverage = np.zeros((len(l0_x), len(classes)), dtype=np.float32)
    for column, name in enumerate(classes):
        coverage[:, column] = tile_share(cells.share(name))
    return SlideAnnotations(
        keep=keep, coverage=coverage, areas={n: areas[n] for n in classes}, notes=notes
    )


def _measure(shapes: list[Shape], lattice: Lattice) -> tuple[ClassCells, list[Shape], list[str]]:
    """The shapes on the lattice, after repairing invalid ones. Validity (GEOS, ~0.3 ms per
    1,000 vertices, without the GIL) is checked in a thread while the lattice is measured
    assuming every shape is valid, the common case; the rare invalid file is measured again."""
    geometries = np.asarray([s.geometry for s in shapes], dtype=object)
    with ThreadPoolExecutor(max_workers=1) as pool:
        validity = pool.submit(shapely.is_valid, geometries)
        try:
            cells: ClassCells | None = ClassCells(shapes, lattice)
        except shapely.errors.GEOSException:  # an invalid shape can break the clipping
            cells = None
        valid = np.asarray(validity.result(), dtype=bool)
    if cells is not None and valid.all():
        return cells, shapes, []
    fixed = repair(shapes, valid)
    return ClassCells(fixed.shapes, lattice), fixed.shapes, fixed.notes


def to_columns(
    coverage: npt.NDArray[np.float32], names: Sequence[str], columns: Sequence[str]
) -> npt.NDArray[np.float32]:
    """Coverage with columns ``names`` rearranged into the columns ``columns`` (a superset for
    the slides' own classes; classes a slide lacks are 0)."""
    out = np.zeros((len(coverage), len(columns)), dtype=np.float32)
    position = {name: i for i, name in enumerate(columns)}
    for i, name in enumerate(names):
        if name in position:
            out[:, position[name]] = coverage[:, i]
    return out


def label_names(classes: Sequence[str], cfg: IndexConfig) -> list[str]:
    """Tile label names: every class but the excluded ones, plus the background label."""
    names = set(classes) - set(cfg.exclude)
    if cfg.background_label is not None:
        names.add(cfg.background_label)
    return label_order(names)


def label_tiles(
    coverage: npt.NDArray[np.float32],
    classes: Sequence[str],
    areas: dict[str, float],
    names: Sequence[str],
    cfg: IndexConfig,
) -> npt.NDArray[np.int32]:
    """Label ids (positions in ``names``) of one slide's tiles; ``coverage`` has a column per
    class of ``classes`` (the index's), ``areas`` the slide's class areas."""
    column = assign_labels(
        coverage, list(classes), areas, cfg.min_coverage, cfg.class_priority, frozenset(cfg.exclude)
    )
    ids = np.array([names.index(c) if c in names else -1 for c in classes] + [-1], dtype=np.int32)
    labels = ids[column]  # column -1 picks the trailing -1
    if cfg.background_label is not None:
        labels[labels < 0] = names.index(cfg.background_label)
    return labels
