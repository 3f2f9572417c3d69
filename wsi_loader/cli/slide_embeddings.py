"""`wsi-loader slide-embeddings`: one embedding per slide from a features folder, by a
registry slide encoder (CHIEF...); and the slide encoders' part of `wsi-loader encoders`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from wsi_loader.cli.common import COMMON, Subparsers, print_columns


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "slide-embeddings",
        help="one embedding per slide from the features of its patch encoder (CHIEF...)",
        parents=[COMMON],
        description="Run a slide encoder (`wsi-loader encoders --slide` lists them) over each "
        "per-slide h5 file of a features folder (the --out of `wsi-loader features --model "
        "NAME`, NAME the patch encoder the slide encoder was trained on); write "
        "OUT/slide_embeddings.h5 (embeddings S x dim, slides) and OUT/slide_embeddings.csv "
        "(one line per slide: row, width, tiles, patch and slide encoder, status). Reruns keep "
        "the slides already embedded.",
    )
    p.add_argument("features", metavar="DIR", help="a features folder (per-slide h5 files)")
    p.add_argument("--model", required=True, metavar="NAME", help="the slide encoder")
    p.add_argument(
        "--weights",
        metavar="FILE|DIR",
        help="its published weight file, or a folder holding it (default: the local Hugging "
        "Face cache, else a download when the hub is reachable)",
    )
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--device", metavar="D", help="cuda, cuda:1, cpu (default: cuda if there)")
    p.add_argument(
        "--patch-size-level0",
        type=int,
        metavar="PX",
        help="the tiles' edge in level-0 pixels, for features files that do not say it",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the embeddings of another slide encoder in OUT",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_loader.features._slide_embeddings import EMBEDDINGS_H5, embed_slides

    report = embed_slides(
        args.features,
        args.model,
        args.out,
        weights=args.weights,
        device=args.device,
        patch_size_level0=args.patch_size_level0,
        overwrite=args.overwrite,
    )
    print(
        f"{report.written} slides embedded -> {args.out}/{EMBEDDINGS_H5} ({report.skipped} "
        f"already there, {report.empty} without tiles, {len(report.failures)} failed: see "
        "slide_embeddings.csv)",
        file=sys.stderr,
    )
    return 1 if report.failures else 0


def slide_rows() -> list[dict[str, Any]]:
    """Each slide encoder as a JSON object, with ``weights_present`` (in the local HF cache)."""
    from wsi_loader.models._encoder_weights import weights_present
    from wsi_loader.models._slide_encoders import SLIDE_RECIPES

    return [
        {
            **r.describe(),
            "weights_present": r.repo is not None and weights_present(r.weights_recipe()),
        }
        for r in SLIDE_RECIPES
    ]


def print_slide_encoders(as_json: bool) -> None:
    """``wsi-loader encoders --slide``: the slide encoders as a table, or a JSON list."""
    table = slide_rows()
    if as_json:
        print(json.dumps(table, indent=1))
        return
    header = ("slide encoder", "dim", "takes", "mpp", "patch", "repo", "gated", "weights", "runs")
    lines = [header]
    for r in table:
        lines.append(
            (
                r["name"],
                str(r["dim"]),
                r["patch_encoder"],
                "-" if r["mpp"] is None else f"{r['mpp']:g}",
                str(r["patch_size"] or "-"),
                str(r["repo"] or r["weights_url"]),
                "gated" if r["gated"] else "open",
                "present" if r["weights_present"] else "-",
                "yes" if r["wired"] else "not yet",
            )
        )
    print_columns(lines)
