"""A slide viewer in the browser: Deep Zoom tiles read by this library's readers, with the
index's grid, labels, failures, annotations, tissue mask, QC columns and predictions over them.

``wsi-loader serve IDX`` (or `serve`) runs it in the foreground; `show` embeds it in a
notebook from a server on a background thread (`ViewerServer`).

- `_server`: the uvicorn server (foreground, or a thread for notebooks) and its address
- `_limits`: bounds on connections (how many, how long a request's head may take)
- `_app`: the ASGI app (Starlette): routes, the page, JSON of slides and overlays
- `_tiles`, `_geometry`: Deep Zoom tiles read through the handle pool, and their geometry
- `_catalog`: the index's slides as the viewer lists them; `_overlays`: grid, labels,
  failures, annotations, tissue and QC over a slide; `_predictions`: predict's CSV files as
  heatmap rasters (read by predict's own reader)
- `_security`: who may ask for what (loopback hosts only, or a token on other binds)
- `_public`: what the page is told of an error (a short reason; the full text is logged)
- ``web/`` the page; ``frontend/`` the npm project OpenSeadragon comes from (``make frontend``
  copies it to ``static/``)

Imports the slides and index layers and predict's files; never torch.
"""

from wsi_loader.view.browser._app import create_app
from wsi_loader.view.browser._limits import ConnectionLimits
from wsi_loader.view.browser._server import ViewerFrame, ViewerServer, serve, show, stop_shown
from wsi_loader.view.browser._tiles import TileOptions

__all__ = [
    "ConnectionLimits",
    "TileOptions",
    "ViewerFrame",
    "ViewerServer",
    "create_app",
    "serve",
    "show",
    "stop_shown",
]
