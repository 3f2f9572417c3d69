"""`wsi-loader predict`: tile probabilities, QuPath tile objects, heatmaps and slide results
(or, over a features folder, a MIL model's slide predictions and attention heatmaps)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wsi_loader.cli._index_on_the_way import INDEX_ON_THE_WAY
from wsi_loader.cli._model_pass import (
    MODEL_PASS,
    index_model_and_keywords,
    start,
    unfinished_slides,
)
from wsi_loader.cli.common import (
    COMMON,
    READS,
    TILES,
    Subparsers,
    class_names,
    one_line,
)
from wsi_loader.cli.encoders import ENCODER_OPTIONS, HEAD_OPTION, pass_model
from wsi_loader.cli.index import GRID_KEYS
from wsi_loader.cli.stain import add_stain_options, stain_option
from wsi_loader.errors import ConfigError


def _number(value: str, kind: type[float] | type[int], what: str) -> float:
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {value!r}") from None


def probability(value: str) -> float:
    """--threshold: in [0, 1] (refused naming the option, not the library's keyword)."""
    number = _number(value, float, "must be a number in [0, 1]")
    if not 0 <= number <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return number


def top_k(value: str) -> int:
    """--top-k: a whole number >= 1."""
    number = int(_number(value, int, "must be a whole number >= 1"))
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return number


def heatmap_size(value: str) -> int:
    """--heatmap-size: 64 to 8192 pixels."""
    number = int(_number(value, int, "must be a whole number of pixels, 64 to 8192"))
    if not 64 <= number <= 8192:
        raise argparse.ArgumentTypeError(f"must be 64 to 8192 pixels, got {value}")
    return number


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "predict",
        help="run a trained model over every tile: per-slide CSV/GeoJSON, heatmaps, slide results",
        parents=[COMMON, READS, TILES, MODEL_PASS, ENCODER_OPTIONS, HEAD_OPTION, INDEX_ON_THE_WAY],
        description="Write DIR/model-outputs-csv/<slide>.csv (minx,miny,width,height,"
        "prob_<class>), DIR/model-outputs-geojson/<slide>.json (QuPath tile objects), "
        "DIR/heatmaps/<slide>.png, DIR/slides.csv, DIR/metrics.json (when slides or tiles have "
        "labels) and DIR/predict.json. Reruns skip complete slides; under torchrun, ranks split "
        "the slides. With --mil-model, PATH is a features folder (wsi-loader features) and a MIL "
        "model runs over each slide's bag. PATH may be slides instead of an index: they are "
        "indexed first (--index-out).",
    )
    p.add_argument(
        "index",
        nargs="+",
        metavar="PATH",
        help="an index; or slide files, folders, globs or CSV manifests (indexed first); "
        "or, with --mil-model, a features folder",
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model",
        metavar="SPEC",
        help="torchvision:NAME, timm:NAME, package.module:callable, or a TorchScript file "
        "(model.pt, with model.json or WSInfer's config.json beside it)",
    )
    model.add_argument(
        "--mil-model",
        metavar="SPEC",
        help="a bag model (package.module:callable or TorchScript) over FEATURES_DIR: "
        "features (1, N, D) -> logits, or (logits, attention)",
    )
    p.add_argument("--classes", type=class_names, metavar="A,B,..", help="class names, in order")
    p.add_argument("--multi-label", action="store_true", help="sigmoid per class, not softmax")
    p.add_argument("--tta", choices=["none", "flips", "d4"], default="none")
    p.add_argument("--heatmap-class", metavar="NAME", help="draw this class only")
    p.add_argument("--heatmap-size", type=heatmap_size, default=1024, metavar="PX")
    p.add_argument("--no-heatmaps", action="store_true")
    p.add_argument(
        "--slide-rule",
        choices=["mean", "max", "topk"],
        default="mean",
        help="a slide's score per class: mean, max or top-k mean of its tile probabilities",
    )
    p.add_argument("--top-k", type=top_k, default=10, metavar="K")
    p.add_argument(
        "--threshold",
        type=probability,
        default=0.5,
        help="for the share of tiles at or above it, multi-label slide calls, and the calls of "
        "a one-output model (slides.csv's predicted, each tile's GeoJSON classification)",
    )
    p.add_argument(
        "--index",
        dest="mil_index",
        metavar="IDX",
        help="with --mil-model: the index the features "
        "came from (finds the slides for heatmaps and labels; default: the paths in the files)",
    )
    p.add_argument("--labels", metavar="CSV", help="with --mil-model: slide labels for metrics")
    add_stain_options(p, config=True)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_loader.predict._metrics import table

    start(args)
    common = {
        "classes": args.classes,
        "multi_label": args.multi_label,
        "heatmaps": not args.no_heatmaps,
        "heatmap_class": args.heatmap_class,
        "heatmap_size": args.heatmap_size,
        "slide_rule": args.slide_rule,
        "top_k": args.top_k,
        "threshold": args.threshold,
    }
    _refuse_ignored(args)
    if args.mil_model and stain_option(args) is not None:
        raise ConfigError(
            "--stain (or a stain section in --config) goes with --model: a MIL model reads "
            "features, stain them when you extract them (wsi-loader features --stain)",
            path="command line",
        )
    if not args.mil_model and (args.mil_index or args.labels):
        raise ConfigError(
            "--index and --labels go with --mil-model (a features folder); an index's labels "
            "are used by --model as they are",
            path="command line",
        )
    if args.mil_model:
        from wsi_loader.predict._mil import predict_bags

        args.index = _features_folder(args)
        pass_model(args)  # --weights and --batch-size auto are for --model
        report = predict_bags(
            args.index,
            args.mil_model,
            args.out,
            index=args.mil_index,
            labels=args.labels,
            device=args.device,
            split=args.split,
            root=args.root,
            overwrite=args.overwrite,
            **common,
        )
    else:
        model, keywords = index_model_and_keywords(args)
        # imported once the slides are checked (refused at once if bad): it imports torch
        from wsi_loader.predict._run import predict

        report = predict(
            args.index,
            model,
            args.out,
            tta=args.tta,
            **keywords,
            **common,
        )
    print(
        f"{report.tiles} tiles of {report.written} slides -> {args.out} ({report.skipped} slides "
        f"already complete, {report.failed} tiles failed: see predict.json); "
        f"slide results: {Path(args.out) / 'slides.csv'}",
        file=sys.stderr,
    )
    for level in ("slides", "tiles"):
        if report.metrics and level in report.metrics:
            print(table(report.metrics[level], f"{level[:-1]} level"), file=sys.stderr)
    for row in report.slide_results[:20]:
        label = f" (label {one_line(row['label'])})" if row["label"] else ""
        print(f"  {one_line(row['name'])}: {one_line(row['predicted'])}{label}", file=sys.stderr)
    if len(report.slide_results) > 20:
        print(f"  ... {len(report.slide_results) - 20} more in slides.csv", file=sys.stderr)
    return unfinished_slides(report, None if args.mil_model else args.dtype)


# the options of the tile pass (reading slides, running the model over tiles, tile
# probabilities into slide scores), at their defaults: a MIL model reads a features folder and
# makes the slide call itself, so any other value would be silently ignored
_TILE_PASS_ONLY = {
    "ray": None,
    "tta": "none",
    "workers": None,
    "timeout": 0,
    "dtype": "float32",
    "batch_size": 64,
    "slide_rule": "mean",
    "top_k": 10,
    "missing_slides": "raise",
    "quarantine": None,
}


def _refuse_ignored(args: argparse.Namespace) -> None:
    """Options that would be silently ignored in this combination are refused, naming both
    (before anything is read or written)."""

    def flag(key: str) -> str:
        return "--" + key.replace("_", "-")

    if args.mil_model:
        given = [key for key, default in _TILE_PASS_ONLY.items() if getattr(args, key) != default]
        if args.root is not None and args.mil_index is None:
            given.append("root")  # remaps the slides of --index only
        if given:
            names = ", ".join(flag(key) for key in given)
            raise ConfigError(
                f"{names} cannot go with --mil-model: they are options of the tile pass "
                "(--model); a MIL model reads the features folder and makes the slide call "
                "itself (--root goes with --index)",
                path="command line",
            )
    if args.no_heatmaps:
        given = [
            key
            for key, default in (("heatmap_class", None), ("heatmap_size", 1024))
            if getattr(args, key) != default
        ]
        if given:
            raise ConfigError(
                f"{', '.join(flag(key) for key in given)} cannot go with --no-heatmaps "
                "(it draws no heatmaps)",
                path="command line",
            )


def _features_folder(args: argparse.Namespace) -> str:
    """With --mil-model, PATH is one features folder: nothing is indexed on the way."""
    grid = [key for key in GRID_KEYS if getattr(args, key) is not None]
    if len(args.index) != 1 or args.index_out is not None or grid:
        raise ConfigError(
            "with --mil-model, PATH is one features folder (wsi-loader features), and "
            "--index-out and the grid options (--tile-size, --mpp...) go with --model",
            path="command line",
        )
    return str(args.index[0])
