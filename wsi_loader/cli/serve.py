"""`wsi-loader serve`: the slide viewer in the browser (see `wsi_loader.view`)."""

from __future__ import annotations

import argparse
import sys

from wsi_loader.cli.common import COMMON, READS, Subparsers, open_index
from wsi_loader.errors import ConfigError


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "serve",
        help="a slide viewer in the browser: tiles, grid, labels, failures, predictions",
        parents=[COMMON, READS],
    )
    p.add_argument("index", metavar="INDEX")
    p.add_argument(
        "--predictions", metavar="DIR", help="output folder of wsi-loader predict (heatmaps)"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; any other needs a token)",
    )
    p.add_argument(
        "--port",
        type=port_number,
        metavar="N",
        help="port, 0-65535 (default: the first free of 8000-8019; 0: any free one)",
    )
    p.add_argument(
        "--token",
        help="required of every request for data (generated for a non-loopback --host)",
    )
    p.add_argument("--open", action="store_true", help="open the page in a browser")
    p.add_argument(
        "--tile-size",
        type=int,
        metavar="PX",
        help="Deep Zoom tile size (default: each slide's storage tile size, so stored JPEG "
        "tiles are sent as they are)",
    )
    p.add_argument(
        "--quality", type=int, default=75, help="JPEG quality of tiles made anew (default 75)"
    )
    p.add_argument(
        "--cache-mb", type=int, default=256, help="memory for encoded tiles (default 256 MiB)"
    )
    p.add_argument("--threads", type=int, help="reading threads (default: usable cores, >= 2)")
    p.set_defaults(run=run)


def port_number(text: str) -> int:
    """``--port``: a TCP port, refused by argparse (exit 2) when out of range."""
    from wsi_loader.view.browser._server import check_port

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    try:
        check_port(port)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return port


def run(args: argparse.Namespace) -> int:
    from wsi_loader.view.browser import TileOptions, serve

    tiles = TileOptions(
        tile_size=args.tile_size,
        quality=args.quality,
        cache_mb=args.cache_mb,
        threads=args.threads,
    )
    index = open_index(args)

    def ready(urls: list[str]) -> None:
        # one line: every address it answers on (a wildcard --host lists this machine's)
        print(
            f"serving {len(index.slides)} slides of {args.index} on {', '.join(urls)}", flush=True
        )
        print("press Ctrl-C to stop", file=sys.stderr, flush=True)

    serve(
        index,
        predictions=args.predictions,
        host=args.host,
        port=args.port,
        token=args.token,
        open_browser=args.open,
        tiles=tiles,
        on_ready=ready,
    )
    return 0  # stopped otherwise than by Ctrl-C (which ends the command with 130)
