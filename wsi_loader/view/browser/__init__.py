"""A slide viewer in the browser: Deep Zoom tiles read by this library's readers, with the
index's grid, labels, failures, annotations, tissue mask, QC columns and predictions over them.

``wsi-loader serve IDX`` (or `serve`) runs it in the foreground; `show` embeds it in a
notebook from a server on a background thread (`ViewerServer`). The top floor of the package:
it imports the slides and index layers, never torch.
"""

from wsi_loader.view.browser._app import create_app
from wsi_loader.view.browser._server import ViewerFrame, ViewerServer, serve, show, stop_shown
from wsi_loader.view.browser._tiles import TileOptions

__all__ = [
    "TileOptions",
    "ViewerFrame",
    "ViewerServer",
    "create_app",
    "serve",
    "show",
    "stop_shown",
]
