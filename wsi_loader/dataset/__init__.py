"""torch Datasets, samplers and batches over a SlideIndex."""

from wsi_loader.dataset.bags import SlideBagDataset
from wsi_loader.dataset.reading import ReadResult, TileReader
from wsi_loader.dataset.samplers import (
    BalancedTileSampler,
    DistributedTileSampler,
)
from wsi_loader.dataset.tiles import TileDataset

__all__ = [
    "BalancedTileSampler",
    "DistributedTileSampler",
    "ReadResult",
    "SlideBagDataset",
    "TileDataset",
    "TileReader",
]
