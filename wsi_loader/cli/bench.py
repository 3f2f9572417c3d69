"""`wsi-loader bench`: tile throughput on the user's own slides and storage."""

from __future__ import annotations

import argparse
import json

from wsi_loader.cli.common import COMMON, READS, TILES, Subparsers, open_index
from wsi_loader.errors import ConfigError

DEFAULT_STEP_MS = 50.0  # bench --device: a mid-sized model's step per batch


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "bench",
        help="measure tile throughput on your slides and storage",
        parents=[COMMON, READS, TILES],
    )
    p.add_argument("index", metavar="INDEX")
    p.add_argument("--workers", type=int, metavar="N", help="largest DataLoader worker count")
    p.add_argument("--batch-size", type=int, default=64, metavar="B")
    p.add_argument("--tiles", type=int, default=2000, metavar="N", help="tiles per measurement")
    p.add_argument("--device", metavar="D", help="also feed this device (cpu, cuda)")
    p.add_argument(
        "--step-ms",
        type=float,
        metavar="MS",
        help="with --device: simulated model step per batch (default 50)",
    )
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="measure with N other processes spinning on a core each (a busy machine)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_loader.dataset._loader import default_workers
    from wsi_loader.device._bench import format_table, run_bench

    top = default_workers() if args.workers is None else args.workers
    if top < 0 or args.batch_size < 1 or args.tiles < 1:
        raise ConfigError(
            "--workers must be >= 0, --batch-size and --tiles >= 1", path="command line"
        )
    if args.step_ms is not None and (args.device is None or args.step_ms < 0):
        raise ConfigError(
            "--step-ms is the model step of --device, in milliseconds >= 0",
            path="command line",
        )
    from wsi_loader.device._devices import resolve_device
    from wsi_loader.index._health import require_slides

    if args.device is not None:
        resolve_device(args.device)  # before any slide is opened

    index = require_slides(open_index(args), args.missing_slides)
    result = run_bench(
        index,
        tiles=args.tiles,
        batch_size=args.batch_size,
        workers=sorted({0, *range(1, top + 1)}),
        device=args.device,
        step_ms=DEFAULT_STEP_MS if args.step_ms is None else args.step_ms,
        busy=args.busy,
    )
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
