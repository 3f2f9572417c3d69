"""Slide index: tissue detection, grid layout, the on-disk table and its builder.

This layer never imports torch, so indexing runs on machines without it.
"""

from wsi_loader.index._builder import build_index
from wsi_loader.index._qc import qc_filter
from wsi_loader.index._quarantine import Quarantine
from wsi_loader.index._slide_task import index_slide
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import SCHEMA_VERSION, TILE_COLUMNS, SlideRecord

__all__ = [
    "SCHEMA_VERSION",
    "TILE_COLUMNS",
    "Quarantine",
    "SlideIndex",
    "SlideRecord",
    "build_index",
    "index_slide",
    "qc_filter",
]
