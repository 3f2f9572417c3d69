"""`wsi-loader features --format anndata` / ``--anndata FILE``: the features folder also
written as one ``.h5ad`` (`wsi_loader.features._anndata`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_anndata_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        choices=["h5", "anndata"],
        default="h5",
        help="h5: one CLAM/TRIDENT h5 per slide (default); anndata: also OUT/features.h5ad "
        "(X features, obs slide/x/y/label/split, obsm['spatial'])",
    )
    p.add_argument(
        "--anndata",
        metavar="FILE",
        help="also write the features as this .h5ad (implies --format anndata)",
    )


def write_requested(args: argparse.Namespace) -> None:
    """After the pass: the .h5ad, when asked for."""
    if args.format != "anndata" and not args.anndata:
        return
    from wsi_loader.features._anndata import write_anndata
    from wsi_loader.index import SlideIndex

    out = Path(args.anndata) if args.anndata else Path(args.out) / "features.h5ad"
    index = SlideIndex.open(args.index, root=args.root, split=args.split)
    tiles = write_anndata(args.out, index, out)
    print(f"{tiles} tiles -> {out}", file=sys.stderr)
