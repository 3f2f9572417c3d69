"""Freeze a tile dataset to disk for other tools: image folders or WebDataset tar shards.

The export is cut into deterministic units (a shard's rows, or a fixed chunk of rows for image
folders). Each unit is a plain function of small arguments (`export_unit`) that reads its tiles
through the dataset's `TileReader` (same backends, retries and quarantine), writes its files
under temporary names, renames them into place, and writes a small part record last; it returns
only that record (never pixels), so units run inline, in a process pool or on a Dask cluster.

Resuming: a unit whose record exists and whose files are intact (recorded sizes; SHA-256 with
``verify``) is complete and is skipped, so a second run with the same arguments writes only
what is missing. Records, settings and the plan are hidden plain files in the output root
(``.export-*``, see `export_folder`), never folders, so image-folder readers see only class
folders. Different arguments, or an index rebuilt with other tiles, into a folder holding an
export are refused (``overwrite`` replaces it). ``manifest.csv`` (one row per exported tile,
with its split and the SHA-256 of the stored bytes), ``failures.csv`` (tiles not exported and
why: quarantined before, failed now, or without a label in image folders) and ``export.json``
(arguments, source index and counts) are written at the end, and the dataset card
(``README.md``, `dataset_card`) that tells Hugging Face ``datasets`` the split, the classes and
the field types.
"""

from wsi_loader.export._export import EXPORT_VERSION, FORMATS, ExportReport, export_index, log
from wsi_loader.export._imagefolder import label_folders
from wsi_loader.export._manifest import FAILURE_COLUMNS, MANIFEST_COLUMNS, tile_label
from wsi_loader.export._unit import IMAGE_FORMATS, ExportOptions, ExportUnit, export_unit

__all__ = [
    "EXPORT_VERSION",
    "FAILURE_COLUMNS",
    "FORMATS",
    "IMAGE_FORMATS",
    "MANIFEST_COLUMNS",
    "ExportOptions",
    "ExportReport",
    "ExportUnit",
    "export_index",
    "export_unit",
    "label_folders",
    "log",
    "tile_label",
]
