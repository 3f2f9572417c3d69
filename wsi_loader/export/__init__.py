"""Freeze a tile dataset to disk for other tools: image folders, WebDataset tar shards, or the
tiles' coordinates as HDF5 (``export_index``; ``wsi-loader export`` on the command line).

Its modules:

* ``_export``: the orchestration: `export_index` checks its options, fixes the plan (which
  rows, in which order, which left out and why), cuts it into units, runs them in parallel
  (inline, local processes, any executor or Dask), and writes ``manifest.csv``,
  ``failures.csv``, ``export.json`` and the dataset card.
* ``_running``: the units run: completed ones read back from the part records, the others
  in parallel, given-up ones (a dead worker, ``unit_timeout``) reported together.
* ``_unit``: one unit of work (`export_unit`): read its tiles, encode them, write its files,
  append its part record.
* ``_imagefolder``: the image-folder layout: a folder per label (`label_folders`), a file per
  tile.
* ``_webdataset``: WebDataset samples (key, JSON, context tiles) and tar shards.
* ``_coords_h5``: the coordinates export, one HDF5 file per slide (CLAM's and TRIDENT's
  layout).
* ``_manifest``: the columns of ``manifest.csv`` and ``failures.csv``, and a tile's fields.
* ``_folder``: what the export's folder holds besides its tiles (settings, plan, part
  records) and what a rerun makes of it (resume, refuse, ``overwrite``).
* ``_card``: the dataset card (``README.md``) for Hugging Face ``datasets``.

It may import the earlier steps (`wsi_loader.slides`, `wsi_loader.index`, `wsi_loader.stain`,
`wsi_loader.dataset`) and the foundations (`wsi_loader.errors`, `wsi_loader.files`,
`wsi_loader.config`, `wsi_loader.parallel`, `wsi_loader.permutation`), never a later one.
"""

from wsi_loader.export._export import FORMATS, ExportReport, export_index
from wsi_loader.export._imagefolder import label_folders
from wsi_loader.export._manifest import FAILURE_COLUMNS, MANIFEST_COLUMNS
from wsi_loader.export._unit import IMAGE_FORMATS

__all__ = [
    "FAILURE_COLUMNS",
    "FORMATS",
    "IMAGE_FORMATS",
    "MANIFEST_COLUMNS",
    "ExportReport",
    "export_index",
    "label_folders",
]
