"""wsi_loader: stream tiles out of whole-slide images into PyTorch.

Data flow: ``slides`` (readers) -> ``index`` (SlideIndex on disk) -> ``dataset`` (torch
Datasets, samplers, batches). The slides and index layers never import torch, and importing
this package does not either until a torch-based name is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wsi_loader.config import Config, DatasetConfig, IndexConfig, load_config
from wsi_loader.errors import (
    ConfigError,
    IndexFormatError,
    InputError,
    ResolutionError,
    SlideError,
    SlideNotFoundError,
    SlideOpenError,
    TileReadError,
    WsiLoaderError,
)
from wsi_loader.index import Quarantine, SlideIndex, SlideRecord, build_index
from wsi_loader.slides import HandlePool, SlideMeta, open_slide

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DatasetConfig",
    "HandlePool",
    "IndexConfig",
    "IndexFormatError",
    "InputError",
    "Quarantine",
    "ResolutionError",
    "SlideError",
    "SlideIndex",
    "SlideMeta",
    "SlideNotFoundError",
    "SlideOpenError",
    "SlideRecord",
    "TileReadError",
    "WsiLoaderError",
    "build_index",
    "load_config",
    "open_slide",
]

# torch-based names, imported on first use so `import wsi_loader` stays torch-free.
_LAZY: dict[str, str] = {}

if TYPE_CHECKING:
    pass


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wsi_loader' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
