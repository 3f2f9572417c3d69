"""torch Datasets, samplers and batches over a SlideIndex.

Names are imported on first use: `wsi_loader.dataset._reading` (the torch-free reader that the
exporter and the views use) can be imported without paying for torch, which keeps spawned
export workers quick to start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "BalancedTileSampler": "wsi_loader.dataset._samplers",
    "DistributedTileSampler": "wsi_loader.dataset._samplers",
    "FeatureBagDataset": "wsi_loader.dataset._feature_bags",
    "pad_bags": "wsi_loader.dataset._feature_bags",
    "ReadResult": "wsi_loader.dataset._failures",
    "SlideBagDataset": "wsi_loader.dataset._bags",
    "TileBatch": "wsi_loader.dataset._batch",
    "TileDataset": "wsi_loader.dataset._tiles",
    "TileReader": "wsi_loader.dataset._reading",
    "make_loader": "wsi_loader.dataset._loader",
}

__all__ = [
    "BalancedTileSampler",
    "DistributedTileSampler",
    "FeatureBagDataset",
    "ReadResult",
    "SlideBagDataset",
    "TileBatch",
    "TileDataset",
    "TileReader",
    "make_loader",
    "pad_bags",
]

if TYPE_CHECKING:
    from wsi_loader.dataset._bags import SlideBagDataset
    from wsi_loader.dataset._batch import TileBatch
    from wsi_loader.dataset._failures import ReadResult
    from wsi_loader.dataset._feature_bags import FeatureBagDataset, pad_bags
    from wsi_loader.dataset._loader import make_loader
    from wsi_loader.dataset._reading import TileReader
    from wsi_loader.dataset._samplers import BalancedTileSampler, DistributedTileSampler
    from wsi_loader.dataset._tiles import TileDataset


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wsi_loader.dataset' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
