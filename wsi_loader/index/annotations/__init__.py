"""Region annotations (QuPath GeoJSON, ASAP XML, Aperio XML) as per-tile class coverage.

Torch-free like the rest of the index: ``formats`` parses files into class-named level-0
polygons (a module per file format, what they share in ``shapes``), ``regions`` merges one
slide's files into one geometry per class, ``coverage`` computes each tile's covered share
and label, ``matching`` pairs files with slides.
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
