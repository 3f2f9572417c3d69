"""`wsi-loader features`: per-slide tile embeddings (CLAM/TRIDENT h5 layout)."""

from __future__ import annotations

import argparse
import sys

from wsi_loader.cli._anndata import add_anndata_options, write_requested
from wsi_loader.cli._index_on_the_way import INDEX_ON_THE_WAY
from wsi_loader.cli._model_pass import (
    MODEL_PASS,
    index_model_and_keywords,
    start,
    unfinished_slides,
)
from wsi_loader.cli.common import COMMON, READS, TILES, Subparsers
from wsi_loader.cli.encoders import ENCODER_OPTIONS
from wsi_loader.cli.stain import add_stain_options


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "features",
        help="per-slide tile embeddings for MIL training (CLAM/TRIDENT h5 layout)",
        parents=[COMMON, READS, TILES, MODEL_PASS, ENCODER_OPTIONS, INDEX_ON_THE_WAY],
        description="Run a frozen encoder over every tile; write OUT/<slide>.h5 with features "
        "(N x D) and coords (N x 2, level-0 x, y), and OUT/features.json. Reruns skip complete "
        "slides. Under torchrun, ranks split the slides. PATH may be slides instead of an index: "
        "they are indexed first (--index-out).",
    )
    p.add_argument(
        "index",
        nargs="+",
        metavar="PATH",
        help="an index; or slide files, folders, globs or CSV manifests (indexed first)",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="SPEC",
        help="an encoder name (wsi-loader encoders; its weights: --weights), "
        "torchvision:NAME (cached weights), timm:NAME, package.module:callable, or a "
        "TorchScript file (model.pt, with model.json or config.json beside it)",
    )
    p.add_argument(
        "--context",
        metavar="MPP:SIZE[,MPP:SIZE]",
        help="also encode co-centred context tiles (default: the index's --context; '' none)",
    )
    p.add_argument(
        "--context-features",
        choices=["separate", "concat"],
        default="separate",
        help="separate: features_ctx1... beside features (default); concat: features is "
        "[tile | ctx1 | ...]",
    )
    add_stain_options(p, config=True)
    add_anndata_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_loader.config import DatasetConfig, validate

    start(args)
    model, keywords = index_model_and_keywords(args)
    # imported once the slides are checked (refused at once if bad): it imports torch
    from wsi_loader.features._extract import extract

    report = extract(
        args.index,
        model,
        args.out,
        **keywords,
        context=(
            None
            if args.context is None
            else validate(DatasetConfig, {"context": args.context}, "command line").context
        ),
        context_features=args.context_features,
    )
    print(
        f"{report.tiles} tiles of {report.written} slides -> {args.out} ({report.skipped} slides "
        f"already complete, {report.failed} tiles failed: see features.json)",
        file=sys.stderr,
    )
    write_requested(args)
    return unfinished_slides(report, args.dtype)
