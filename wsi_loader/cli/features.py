"""`wsi-loader features`: per-slide tile embeddings (CLAM/TRIDENT h5 layout)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from wsi_loader.cli.common import COMMON, READS, TILES, Subparsers, init_distributed, one_line
from wsi_loader.cli.stain import add_stain_options, stain_option

if TYPE_CHECKING:
    from wsi_loader.models._pass import PassReport


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "features",
        help="per-slide tile embeddings for MIL training (CLAM/TRIDENT h5 layout)",
        parents=[COMMON, READS, TILES],
        description="Run a frozen encoder over every tile; write OUT/<slide>.h5 with features "
        "(N x D) and coords (N x 2, level-0 x, y), and OUT/features.json. Reruns skip complete "
        "slides. Under torchrun, ranks split the slides.",
    )
    p.add_argument("index", metavar="IDX")
    p.add_argument(
        "--model",
        required=True,
        metavar="SPEC",
        help="torchvision:NAME (cached weights), timm:NAME, package.module:callable, or a "
        "TorchScript file (model.pt, with model.json or config.json beside it)",
    )
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--batch-size", type=int, default=64, metavar="B")
    p.add_argument("--device", metavar="D", help="cuda, cuda:1, cpu (default: cuda if there)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--workers", type=int, metavar="N", help="DataLoader workers")
    p.add_argument(
        "--timeout",
        type=float,
        default=0,
        metavar="S",
        help="no batch for S seconds (a read that hangs): leave the slides being read for the "
        "next run and go on (needs workers; 0: wait forever)",
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
    p.add_argument("--no-progress", action="store_true")
    add_stain_options(p, config=True)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_loader.config import DatasetConfig, validate
    from wsi_loader.features._extract import extract

    # `--model mymodels:encoder` finds mymodels.py in the current folder, as `python -m` would
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    init_distributed()
    report = extract(
        args.index,
        args.model,
        args.out,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        workers=args.workers,
        split=args.split,
        root=args.root,
        missing_slides=args.missing_slides,
        progress=not args.no_progress,
        quarantine=args.quarantine,
        timeout=args.timeout,
        context=(
            None
            if args.context is None
            else validate(DatasetConfig, {"context": args.context}, "command line").context
        ),
        context_features=args.context_features,
        stain=stain_option(args),
    )
    print(
        f"{report.tiles} tiles of {report.written} slides -> {args.out} ({report.skipped} slides "
        f"already complete, {report.failed} tiles failed: see features.json)",
        file=sys.stderr,
    )
    return unfinished_slides(report, args.dtype)


def unfinished_slides(report: PassReport, dtype: str | None = None) -> int:
    """Print the slides a pass did not write and why; the exit code (1 when there are any).
    ``dtype``: the pass's --dtype (float16 overflows: the advice names it only then)."""
    for entry in report.incomplete:
        print(
            f"  not written: {one_line(entry['slide'])}: {one_line(entry['reason'])}",
            file=sys.stderr,
        )
    for entry in report.failed_slides:
        print(f"  failed: {one_line(entry['slide'])}: {one_line(entry['reason'])}", file=sys.stderr)
    if report.incomplete:
        print("error: some slides could not be read; run the command again", file=sys.stderr)
    if report.failed_slides:
        advice = " (with --dtype float16, try float32 or bfloat16)" if dtype == "float16" else ""
        print(
            f"error: the model's outputs were not finite for some slides{advice}", file=sys.stderr
        )
    return 1 if report.incomplete or report.failed_slides else 0
