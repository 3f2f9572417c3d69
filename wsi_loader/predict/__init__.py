"""Whole-slide prediction (``wsi-loader predict``, `wsi_loader.predict`) and its files.

- `_run`: `predict`, the tile pass's writer (a slide's CSV, GeoJSON, heatmap and state file)
- `_summary`: the run's summary after the pass (``slides.csv``, ``metrics.json``,
  ``predict.json``; `PredictReport`)
- `_outputs`: the files, in WSInfer's layout: the one reader and writer of the per-tile CSV,
  the QuPath GeoJSON, ``predict.json``
- `_heatmaps`: heatmaps drawn over the slide thumbnail (`prediction_heatmap`), on the
  picture helpers of `_pictures` (thumbnails, scale bars, hatching), which `view` reuses
- `_metrics`: slide-level results (``slides.csv`` of a tile model) and metrics with bootstrap
  intervals
- `_mil`: slide predictions of a MIL model over feature bags (``--mil-model``), with its
  attention CSVs and its own ``slides.csv`` (a slide's probabilities, no tile statistics)

``wsi_loader.predict`` itself is the function `predict` (the public API, as before this
package existed); take this package's names with ``from wsi_loader.predict import ...``.

May import: every earlier step (`slides` ... `models`) and the foundation modules; not
`features`, `export`, `view` or `cli`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# imported on first use: the viewer reads predictions (`_outputs`) without paying for torch
_LAZY = {
    "PredictReport": "wsi_loader.predict._summary",
    "SlideHeatmap": "wsi_loader.predict._heatmaps",
    "TilePredictions": "wsi_loader.predict._outputs",
    "prediction_heatmap": "wsi_loader.predict._heatmaps",
    "read_run": "wsi_loader.predict._outputs",
}

__all__ = ["PredictReport", "SlideHeatmap", "TilePredictions", "prediction_heatmap", "read_run"]

if TYPE_CHECKING:
    from wsi_loader.predict._heatmaps import SlideHeatmap, prediction_heatmap
    from wsi_loader.predict._outputs import TilePredictions, read_run
    from wsi_loader.predict._summary import PredictReport


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wsi_loader.predict' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
