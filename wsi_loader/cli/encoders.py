"""`wsi-loader encoders`: the registry of patch encoders (a table, or --json), and what
`features` and `predict` share for ``--model NAME``: the ``--weights`` and ``--strict``
options and the encoder loaded with its resolution checked against the index's."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from wsi_loader.cli.common import COMMON, Subparsers, print_columns

log = logging.getLogger(__name__)

ENCODER_OPTIONS = argparse.ArgumentParser(add_help=False)
ENCODER_OPTIONS.add_argument(
    "--weights",
    metavar="FILE|DIR",
    help="with --model NAME (a registry encoder, see `wsi-loader encoders`): the weight file "
    "its Hugging Face repo serves, or a snapshot folder holding it (default: the local "
    "Hugging Face cache, else a download when the hub is reachable)",
)
ENCODER_OPTIONS.add_argument(
    "--strict",
    action="store_true",
    help="with --model NAME: an index at another resolution or tile size than the encoder "
    "was trained at is an error (default: a warning)",
)

ENCODER_OPTIONS.add_argument(
    "--precision",
    choices=["card", "float32", "float16", "bfloat16"],
    default="card",
    help="with --model NAME on CUDA: autocast in this precision (default: the one its card "
    "recommends; features are written as float32 either way)",
)
ENCODER_OPTIONS.add_argument(
    "--compile",
    action="store_true",
    help="with --model NAME: torch.compile the encoder (a slower start, faster batches)",
)


HEAD_OPTION = argparse.ArgumentParser(add_help=False)
HEAD_OPTION.add_argument(
    "--head",
    metavar="FILE",
    help="with --model NAME: a linear head on the encoder's features, a torch.save'd dict "
    "with weight (classes x dim), bias (classes) and optionally classes (their names)",
)


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "encoders",
        help="list the pathology patch encoders --model NAME takes",
        parents=[COMMON],
        description="The registry of patch encoders with their model cards' recipes: output "
        "width, input size, mean/std, the resolution and patch size they were trained at, the "
        "Hugging Face repo of their weights, licence, and whether the weights are in the local "
        "Hugging Face cache.",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.add_argument(
        "--slide",
        action="store_true",
        help="list the slide encoders (wsi-loader slide-embeddings) instead",
    )
    p.set_defaults(run=run)


def rows() -> list[dict[str, Any]]:
    """Each recipe as a JSON object, with ``weights_present`` (in the local HF cache)."""
    from wsi_loader.models._encoder_recipes import RECIPES
    from wsi_loader.models._encoder_weights import weights_present

    return [{**r.describe(), "weights_present": weights_present(r)} for r in RECIPES]


def run(args: argparse.Namespace) -> int:
    if args.slide:
        from wsi_loader.cli.slide_embeddings import print_slide_encoders

        print_slide_encoders(args.json)
        return 0
    table = rows()
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    header = ("name", "dim", "size", "mpp", "patch", "pooling", "repo", "gated", "weights")
    lines = [header]
    for r in table:
        lines.append(
            (
                r["name"],
                str(r["dim"]),
                str(r["size"] or "as read"),
                f"{r['mpp']:g}",
                str(r["patch_size"]),
                r["pooling"],
                str(r["repo"]),
                "gated" if r["gated"] else "open",
                "present" if r["weights_present"] else "-",
            )
        )
    print_columns(lines)
    return 0


def pass_model(args: argparse.Namespace) -> Any:
    """What --model means for a pass: a registry encoder (with --weights) loaded and its
    resolution checked against the index's, else the spec as it is; --weights without an
    encoder name is a usage error."""
    from wsi_loader.errors import ConfigError
    from wsi_loader.models._encoders import encoder_model, is_encoder_name

    spec = args.model
    if spec is None or not is_encoder_name(spec):
        if args.batch_size == "auto":
            log.info("--batch-size auto probes registry encoders only: 64")
            args.batch_size = 64
        # each means something for a registry encoder only: refused, not silently ignored
        for option in ("weights", "head", "precision", "compile", "strict"):
            if getattr(args, option, None) not in (None, False, "card"):
                raise ConfigError(
                    f"--{option} goes with --model NAME, a registry encoder (wsi-loader encoders)",
                    key=option,
                    value=getattr(args, option),
                )
        return spec
    model = encoder_model(
        spec,
        args.weights,
        precision=None if args.precision == "card" else args.precision,
        compile=args.compile,
    )
    if getattr(args, "head", None):
        from wsi_loader.models._encoder_checks import with_linear_head

        model = with_linear_head(model, args.head)
    if args.batch_size == "auto":
        import torch

        from wsi_loader.models._encoder_checks import auto_batch_size

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        size = getattr(model.model, "size", None) or model.patch_size
        args.batch_size = auto_batch_size(model.model, int(size or 224), device)
    from wsi_loader.index import SlideIndex
    from wsi_loader.models._encoder_checks import check_resolution

    try:
        params = SlideIndex.open(args.index).params
    except Exception:  # a features folder or a broken index: the pass reports it itself
        return model
    check_resolution(model, params, strict=args.strict)
    return model
