"""torch Datasets, samplers and batches over a SlideIndex."""

from wsi_loader.dataset.bags import SlideBagDataset
from wsi_loader.dataset.batch import TileBatch
from wsi_loader.dataset.loader import make_loader
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
    "TileBatch",
    "TileDataset",
    "TileReader",
    "make_loader",
]
