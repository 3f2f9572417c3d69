"""`wsi-loader demo`: synthetic slides -> index -> batches, with throughput."""

from __future__ import annotations

import argparse

from wsi_loader.cli.common import COMMON, Subparsers


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "demo", help="synthetic slides -> index -> batches, with throughput", parents=[COMMON]
    )
    p.add_argument("--out", default="demo", metavar="DIR", help="slides and index go here")
    p.add_argument("--batches", type=int, default=40, metavar="N", help="batches to stream")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_loader.cli._demo import run

    run(args.out, batches=args.batches)
    return 0
