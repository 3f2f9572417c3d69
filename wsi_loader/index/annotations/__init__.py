"""Region annotations (QuPath GeoJSON, Digital Slide Archive JSON, ASAP XML, Aperio and HALO
XML) as per-tile class coverage.

Torch-free like the rest of the index: `_formats` reads a file into class-named level-0
polygons, by its format (`_geojson`, `_dsa`, `_asap`, `_aperio`; what they share in
`_shapes`); `_regions` merges one slide's files into one geometry per class; `_coverage`
(with `_overlaps`) computes each tile's covered share and label; `_matching` pairs files with
slides; `_tiles` applies all of it to an index's tiles.
"""

from wsi_loader.index.annotations._coverage import ClassCells, Lattice, assign_labels
from wsi_loader.index.annotations._formats import read_annotations
from wsi_loader.index.annotations._matching import AnnotationReport, match_annotations
from wsi_loader.index.annotations._regions import (
    SlideRegions,
    files_digest,
    read_regions,
    read_shapes,
)
from wsi_loader.index.annotations._shapes import UNCLASSIFIED

__all__ = [
    "UNCLASSIFIED",
    "AnnotationReport",
    "ClassCells",
    "Lattice",
    "SlideRegions",
    "assign_labels",
    "files_digest",
    "match_annotations",
    "read_annotations",
    "read_regions",
    "read_shapes",
]
