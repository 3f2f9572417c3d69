"""`wsi-loader quarantine`: list, clear or retry the failed reads recorded for an index."""

from __future__ import annotations

import argparse
import json
import sys

from wsi_loader.cli.common import COMMON, QUARANTINE_HELP, Subparsers, one_line
from wsi_loader.index import SlideIndex


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "quarantine",
        help="list, clear or retry the failed reads recorded for an index",
        parents=[COMMON],
        description="Without options: list the records (tile and slide faults).",
    )
    p.add_argument("index", metavar="DIR")
    p.add_argument("--json", action="store_true", help="print the records as one JSON array")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--clear", action="store_true", help="remove records (all, or --slide)")
    action.add_argument(
        "--retry",
        action="store_true",
        help="read quarantined tiles and slides again; keep only the records that still fail",
    )
    p.add_argument("--slide", metavar="PATH_OR_ID", help="only this slide (id, path or name)")
    p.add_argument("--root", metavar="DIR", help="remap the slide root")
    p.add_argument("--quarantine", metavar="FILE", help=QUARANTINE_HELP)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_loader.dataset._quarantine import clear, retry, select

    index = SlideIndex.open(args.index, root=args.root, quarantine=args.quarantine)
    if args.clear:
        kept, removed = clear(index, args.slide)
        print(f"removed {removed} records, {kept} left", file=sys.stderr)
        return 0
    if args.retry:
        kept, removed = retry(index, args.slide)
        print(f"{removed} records cleared (they read fine now), {kept} still fail", file=sys.stderr)
        return 0
    records = select(index, args.slide)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    for r in records:
        where = "whole slide" if r.get("kind") == "slide" else f"x={r['x']} y={r['y']}"
        print(
            f"{r.get('kind', 'tile'):5} {one_line(r['path'])} {where}: {one_line(r.get('error'))}"
        )
    tiles = sum(r.get("kind", "tile") == "tile" for r in records)
    print(f"{tiles} tile and {len(records) - tiles} slide records", file=sys.stderr)
    return 0
