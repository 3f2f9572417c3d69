"""Look at an index: pictures for notebooks and a slide viewer in the browser.

- `_notebook`: `SlideOverview` (the thumbnail with the grid, coloured by tissue, label,
  status, annotation or QC) and `Mosaic` (sampled tiles, as read or stain-transformed): PNG
  renders that show themselves in Jupyter, drawn with predict's picture helpers
- `_summary`: `IndexSummary`, the slides as a table with counts per label
- `browser/`: ``wsi-loader serve`` / `serve` / `show`: Deep Zoom tiles and overlay data (an
  ASGI app on uvicorn) and the page (OpenSeadragon, built from ``browser/frontend``)

The top floor but one (only `cli` is above): may import every earlier step. Names are
imported on first use, so the browser viewer never pays for torch (the notebook pictures
read tiles through the dataset's reader and stain transforms).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_NOTEBOOK = "wsi_loader.view._notebook"
_BROWSER = "wsi_loader.view.browser"
_LAZY = {
    "COLOR_BY": _NOTEBOOK,
    "QC_CLEAN": _NOTEBOOK,
    "QC_COLOURS": _NOTEBOOK,
    "STATUS_COLOURS": _NOTEBOOK,
    "UNLABELLED": _NOTEBOOK,
    "UNREADABLE": _NOTEBOOK,
    "Cell": _NOTEBOOK,
    "ColorBy": _NOTEBOOK,
    "IndexSummary": "wsi_loader.view._summary",
    "Mosaic": _NOTEBOOK,
    "SlideOverview": _NOTEBOOK,
    "tissue_colour": _NOTEBOOK,
    "TileOptions": _BROWSER,
    "ViewerFrame": _BROWSER,
    "ViewerServer": _BROWSER,
    "create_app": _BROWSER,
    "serve": _BROWSER,
    "show": _BROWSER,
    "stop_shown": _BROWSER,
}

__all__ = [
    "COLOR_BY",
    "QC_CLEAN",
    "QC_COLOURS",
    "STATUS_COLOURS",
    "UNLABELLED",
    "UNREADABLE",
    "Cell",
    "ColorBy",
    "IndexSummary",
    "Mosaic",
    "SlideOverview",
    "TileOptions",
    "ViewerFrame",
    "ViewerServer",
    "create_app",
    "serve",
    "show",
    "stop_shown",
    "tissue_colour",
]

if TYPE_CHECKING:
    from wsi_loader.view._notebook import (
        COLOR_BY,
        QC_CLEAN,
        QC_COLOURS,
        STATUS_COLOURS,
        UNLABELLED,
        UNREADABLE,
        Cell,
        ColorBy,
        Mosaic,
        SlideOverview,
        tissue_colour,
    )
    from wsi_loader.view._summary import IndexSummary
    from wsi_loader.view.browser import (
        TileOptions,
        ViewerFrame,
        ViewerServer,
        create_app,
        serve,
        show,
        stop_shown,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wsi_loader.view' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
