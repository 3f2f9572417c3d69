"""`wsi-loader inspect` and `mosaic`: pictures of what an index holds."""

from __future__ import annotations

import argparse
import sys

from wsi_loader.cli.common import COMMON, READS, Subparsers, one_line, open_index
from wsi_loader.cli.stain import add_stain_options, stain_option
from wsi_loader.errors import ConfigError

MIN_THUMBNAIL = 16  # inspect --max-size below this draws nothing useful


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "inspect", help="draw a slide's tile grid over its thumbnail", parents=[COMMON, READS]
    )
    p.add_argument("index", metavar="INDEX")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument("--slide", metavar="PATH_OR_ID", help="slide id, path or name (first ok slide)")
    p.add_argument(
        "--color-by",
        choices=["tissue", "label", "status", "annotation", "qc"],
        help="what colours the tiles (default: tissue); qc: the quality-control rule flagging "
        "each tile (pen, fold, bubble, blur)",
    )
    p.add_argument("--max-size", type=int, default=1024, help="longest side of the thumbnail")
    p.add_argument(
        "--predictions",
        metavar="DIR",
        help="draw the tile probabilities of a predict folder (DIR) as a heatmap instead",
    )
    p.add_argument("--heatmap-class", metavar="NAME", help="with --predictions: this class only")
    p.set_defaults(run=run_inspect)
    p = sub.add_parser(
        "mosaic", help="a grid of sampled tiles with captions", parents=[COMMON, READS]
    )
    p.add_argument("index", metavar="INDEX")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--slide", metavar="PATH_OR_ID")
    p.add_argument("--label")
    p.add_argument("--status", choices=["ok", "quarantined"])
    p.add_argument(
        "--qc",
        choices=["pen", "blur", "fold", "bubble", "any"],
        help="only tiles this quality-control rule flags (any: any rule)",
    )
    p.add_argument("--seed", type=int, default=0)
    add_stain_options(p, config=True)  # each tile as read, then normalised
    p.set_defaults(run=run_mosaic)


def run_inspect(args: argparse.Namespace) -> int:
    from wsi_loader.view._notebook import SlideOverview

    if args.max_size < MIN_THUMBNAIL:
        raise ConfigError(
            f"--max-size must be at least {MIN_THUMBNAIL} pixels, got {args.max_size}",
            path="command line",
            key="max_size",
            value=args.max_size,
        )
    if args.heatmap_class is not None and not args.predictions:
        raise ConfigError(
            "--heatmap-class goes with --predictions DIR (it picks a class of predict's "
            "heatmap); without, inspect draws the slide's tile grid (--color-by)",
            path="command line",
            key="heatmap_class",
        )
    if args.color_by is not None and args.predictions:
        raise ConfigError(
            "--color-by goes without --predictions DIR: with it, inspect draws predict's "
            "heatmap (--heatmap-class picks a class), not the tile grid",
            path="command line",
            key="color_by",
        )
    index = open_index(args)
    if args.predictions:
        from wsi_loader.predict._heatmaps import prediction_heatmap

        heatmap = prediction_heatmap(
            index,
            args.predictions,
            args.slide,
            heatmap_class=args.heatmap_class,
            max_size=args.max_size,
        )
        heatmap.save(args.out)
        print(f"{args.out}: heatmap of {', '.join(heatmap.names)}", file=sys.stderr)
        return 0
    overview = SlideOverview(
        index, args.slide, color_by=args.color_by or "tissue", max_size=args.max_size
    )
    overview.save(args.out)
    print(
        f"{args.out}: {len(overview.cells)} tiles of "
        f"{one_line(index.slides[overview.slide_id].path)}",
        file=sys.stderr,
    )
    return 0


def run_mosaic(args: argparse.Namespace) -> int:
    from wsi_loader.view._notebook import Mosaic

    index = open_index(args)
    mosaic = Mosaic(
        index,
        args.n,
        slide=args.slide,
        label=args.label,
        status=args.status,
        qc=args.qc,
        seed=args.seed,
        stain=stain_option(args),
    )
    mosaic.save(args.out)
    first = ~mosaic.after  # with stain transforms each tile has two panels: count it once
    both = ", each before and after the stain transforms" if mosaic.after.any() else ""
    print(
        f"{args.out}: {int(first.sum())} tiles{both} "
        f"({int((~mosaic.ok[first]).sum())} failed to read)",
        file=sys.stderr,
    )
    return 0
