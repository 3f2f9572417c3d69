"""`wsi-loader stain`: the slides' stain estimates and the archive reference; the ``--stain``
options other commands share (`add_stain_options`, `stain_option`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from wsi_loader.cli.common import COMMON, READS, Subparsers, one_line, open_index, printable
from wsi_loader.config import StainConfig, load_config
from wsi_loader.errors import ConfigError
from wsi_loader.index._labels import split_mask

STAIN_HELP = (
    "normalise tiles to --stain-target with each slide's stain from the index: macenko or reinhard"
)
TARGET_HELP = (
    "an RGB image (png/jpg), a reference JSON (stain IDX --reference --out), an index folder "
    "(its median stain), or a slide (default: this index's median stain)"
)


def add_stain_options(p: argparse.ArgumentParser, config: bool = False) -> None:
    """``--stain METHOD --stain-target T`` (export, features, predict, mosaic); with
    ``config``, also ``--config FILE`` for a command that has none (its ``stain`` section)."""
    p.add_argument("--stain", choices=["macenko", "reinhard"], help=STAIN_HELP)
    p.add_argument("--stain-target", metavar="T", help=TARGET_HELP)
    if config:
        p.add_argument(
            "--config",
            metavar="FILE",
            help="YAML config: its stain section (normalisation and augmentations; --stain "
            "and --stain-target override it)",
        )


def stain_option(args: argparse.Namespace, config: StainConfig | None = None) -> Any:
    """The stain transforms the options ask for (a `wsi_loader.stain.Normalize`, or the list
    a config's ``stain`` section makes), or None. ``config``: that section, when the command
    read the file already; else the one of ``--config`` (if given)."""
    target = getattr(args, "stain_target", None)
    method = getattr(args, "stain", None)
    if config is None:
        path = getattr(args, "config", None)
        config = load_config(path).stain if path else StainConfig()
    if target is not None and method is None and config.normalize is None:
        raise ConfigError(
            "--stain-target needs --stain macenko or --stain reinhard",
            path="command line",
            key="stain",
        )
    if method in (None, "none") and config.normalize in (None, "none") and not config.augment:
        return None  # nothing to build: the transforms' module (it imports torch) stays unread
    from wsi_loader.stain._build import stain_from_config

    steps = stain_from_config(config, method, target)
    return steps[0] if steps is not None and len(steps) == 1 else steps


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "stain",
        help="the slides' stain estimates and the archive's reference stain",
        parents=[COMMON, READS],
        description="List each slide's stain estimate (H and E optical-density vectors, max "
        "concentrations, LAB moments) or why it has none; with --reference, the archive "
        "reference (the median over the slides; --target: fitted from an image or a slide "
        "instead), written as JSON with --out for --stain-target.",
    )
    p.add_argument("index", metavar="IDX")
    p.add_argument("--reference", action="store_true", help="print the reference stain")
    p.add_argument("--target", metavar="IMAGE_OR_SLIDE", help="fit the reference from this")
    p.add_argument("--out", metavar="FILE.json", help="write the reference (with --reference)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def _vector(values: list[float]) -> str:
    return "(" + ", ".join(f"{v:.3f}" for v in values) + ")"


def run(args: argparse.Namespace) -> int:
    from wsi_loader.index._stain_estimates import write_reference
    from wsi_loader.stain._targets import resolve_target

    index = open_index(args)
    if args.reference or args.target or args.out:
        target = args.target if args.target else index
        reference = resolve_target(target)
        source = (
            f"fitted from {args.target}"
            if args.target
            else f"median of the slides of {index.path} ({index.meta.get('generation')})"
        )
        if args.out:
            write_reference(args.out, reference, source)
        if args.json:
            print(json.dumps({**reference.as_json(), "source": source}, indent=1))
        else:
            body = reference.as_json()
            print(printable(f"reference stain ({one_line(source)})"))
            print(f"  H {_vector(body['H'])}  E {_vector(body['E'])}")
            print(f"  max concentrations {_vector(body['max_concentrations'])}")
            print(f"  LAB mean {_vector(body['lab_mean'])}  std {_vector(body['lab_std'])}")
            if args.out:
                print(f"-> {args.out}", file=sys.stderr)
        return 0
    slides: list[dict[str, Any]] = [
        {"slide_id": i, "path": s.path, "stain": s.stain, "stain_error": s.stain_error}
        for i, (s, chosen) in enumerate(
            zip(index.slides, split_mask(index.slides, index.split), strict=True)
        )
        if s.status == "ok" and chosen
    ]
    if args.json:
        print(json.dumps(slides, indent=1))
        return 0
    for s in slides:
        stain = s["stain"]
        text = (
            f"H {_vector(stain['H'])} E {_vector(stain['E'])} "
            f"max {_vector(stain['max_concentrations'])}"
            if stain
            else f"no estimate: {s['stain_error']}"
        )
        print(printable(f"{s['slide_id']:>4} {one_line(s['path'])}: {text}"))
    return 0
