"""Reading tiles of a `SlideIndex`, the step after `index` and `stain`: torch Datasets, samplers
and whole batches, surviving bad data.

Reading (torch-free: the exporter's and views' workers use it too):
- `_reading`: `TileReader`, index rows into one NHWC uint8 buffer, per batch, with a thread
  pool sized by `_cores`
- `_retry`: one window with retries (a failed reader is closed and reopened), then the
  failure policy (``fill``, ``substitute`` or ``raise``)
- `_failures`: `ReadResult` and the failure records: where a tile's failure becomes a
  quarantine record (`wsi_loader.index.Quarantine`; a tile whose bytes fail to decode on the
  device is recorded by `wsi_loader.device`)
- `_context`, `_context_tiles`: co-centred context tiles: their geometry, and their reads
- `_scan`: a whole-slide pass's batches in strip order (each storage tile decoded once)
- `_quarantine`: listing, clearing and retrying the quarantine (``wsi-loader quarantine``)

torch:
- `_tiles`: `TileDataset`; `_bags`: `SlideBagDataset`; `_feature_bags`: `FeatureBagDataset`
  and `pad_bags` over the h5 files `features` writes
- `_samplers`: `DistributedTileSampler`, `BalancedTileSampler` (permutations, not lists)
- `_loader`: `make_loader`, a DataLoader whose workers read whole batches (`_batch_reads`: the
  Dataset they index with batches; `_batch`: `TileBatch`; `_buffers`: batch buffers reused once
  released; `_transport`: the ring of shared slots through which workers hand batches over;
  `_look_ahead`: the next batches' bytes fetched while decoding; `_worker_exit`: workers that
  end cleanly; `_choice`: threads or worker processes for ``num_workers="auto"``;
  `_threaded`: batches read by a thread of the consumer's process, ahead of it)

May import: `slides`, `index`, `stain` and the foundation modules. Names are imported on first
use, so importing the reader does not pay for torch (spawned export workers start quickly).
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
