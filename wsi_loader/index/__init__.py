"""The slide index, the second step: find tissue on a low-resolution level, lay the tile grid
at the target resolution and record the tiles on disk, never decoding full-resolution pixels.

Building (`build_index`):
- `_builder`: a build, from inputs to a new generation: unchanged slides carried over, the
  per-slide work run in parallel, QC columns and annotation labels added, quarantined tiles
  left out, the generation written
- `_slide_task`: one slide's indexing (open, resolution, grid, columns); every slide that
  cannot be indexed becomes a slide record with its reason here
- `_incremental`: what a rebuild may reuse; `_build_checks`: what a build refuses and warns of
- `_inputs`, `_csv_tables`, `_fingerprints`: files, folders, globs, URLs, manifests and labels
  into slide entries; CSV files as spreadsheets save them; a slide's identity and content key
  (`_tiff_directory`: a TIFF's directory, tile offsets and byte counts, that the key covers)

Per slide, from its low-resolution picture (`_analyses` gathers what the builder learns):
- `_lowres`, `_tissue`, `_tissue_masks`: the picture, read once; tissue detection; user masks
- `_geometry`: the level and scale a resolution is read at; the tile grid
- `_qc`, `_qc_pixels`, `_focus`: quality-control columns (pen, fold, bubble, blur, background)
- `_stain_estimates`, `_stain_sampling`: the slide's stain statistics and the archive's
  reference; the pixels a slide's stain is estimated from
- `annotations/`: region annotations as per-tile class coverage and labels

On disk:
- `_table`: `SlideIndex` (opening, views, splits, selection); `_table_files`: the format
  (generations, columns, locks); `_table_writer`: writing a generation atomically; `_checks`:
  what its files must agree on; `_labels`: label names, ids and the warnings about them,
  patients and the slides a split name selects; `_splits`: splits made for an index
  (`wsi-loader split`: patients dealt to train/val/test or k folds, by label and seed)
- `_quarantine`: tiles that failed to read, appended as JSON lines by whichever process hit
  them (the dataset's reader records them; the next build leaves them out); `_health`: slides
  gone missing before reading
- `_lookup`: a slide found from what a user types; `_naming`: output file names from slide names

May import: `slides` and the foundation modules. Never imports torch, so indexing runs on
machines without it.
"""

from typing import TYPE_CHECKING, Any

from wsi_loader.index._quarantine import Quarantine
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import SCHEMA_VERSION, TILE_COLUMNS, SlideRecord

if TYPE_CHECKING:
    from wsi_loader.index._builder import build_index
    from wsi_loader.index._qc import flags as qc_flags
    from wsi_loader.index._qc import qc_filter
    from wsi_loader.index._slide_task import index_slide

# Building names, imported on first use: what reads an index (every DataLoader worker, which a
# spawned worker imports afresh) needs neither the builder nor scipy's filters behind QC.
_LAZY = {
    "build_index": ("wsi_loader.index._builder", "build_index"),
    "index_slide": ("wsi_loader.index._slide_task", "index_slide"),
    "qc_filter": ("wsi_loader.index._qc", "qc_filter"),
    "qc_flags": ("wsi_loader.index._qc", "flags"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'wsi_loader.index' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)


__all__ = [
    "SCHEMA_VERSION",
    "TILE_COLUMNS",
    "Quarantine",
    "SlideIndex",
    "SlideRecord",
    "build_index",
    "index_slide",
    "qc_filter",
    "qc_flags",
]
