"""Tiles of a `SlideIndex` as a Ray Data dataset: read tasks decode on as many CPU nodes as the
cluster has, and GPU trainers (Ray Train's ``get_dataset_shard``) or inference actors consume
the batches, with Ray's back-pressure, retries and node loss handling. Beside `make_loader`,
at the level of `features`, `predict` and `export`: it consumes `dataset`.

- `_source`: `tiles`, and `TileSource`, the Ray Data datasource: read tasks planned from the
  index slide by slide in strip order (`wsi_loader.dataset._scan`), each read by this
  library's `TileReader` into NHWC uint8 blocks; failed tiles are rows with ``ok = False``
  and their reason, recorded in the index's quarantine by the process that read them
- `_executor`: `RayExecutor`, a ``concurrent.futures.Executor`` over Ray tasks: what the index
  builder and the exporter take as ``executor`` (``wsi-loader index --ray ADDRESS``)
- `_pass`: `RayPass`, a model pass (``features``, ``predict``: ``--ray ADDRESS``) read by Ray
  tasks and run by a pool of model actors, written on the driver as locally

An optional extra (``pip install wsi_loader[ray]``): nothing imports ``ray`` until one of these
names is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["RayExecutor", "RayPass", "TileSource", "tiles"]
_MODULES = {
    "RayExecutor": "_executor",
    "RayPass": "_pass",
    "TileSource": "_source",
    "tiles": "_source",
}

if TYPE_CHECKING:
    from wsi_loader.ray._executor import RayExecutor
    from wsi_loader.ray._pass import RayPass
    from wsi_loader.ray._source import TileSource, tiles


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        module = importlib.import_module(f"wsi_loader.ray.{_MODULES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'wsi_loader.ray' has no attribute {name!r}")
