"""`wsi-loader export`: tiles to image folders, WebDataset shards or CLAM coordinates."""

from __future__ import annotations

import argparse
import sys

from wsi_loader.cli.common import (
    COMMON,
    QUARANTINE_HELP,
    TILES,
    Subparsers,
    config_flag,
    dask_client,
)
from wsi_loader.cli.stain import add_stain_options, stain_option
from wsi_loader.config import Config, DatasetConfig, ExportConfig, load_config, validate
from wsi_loader.errors import ConfigError
from wsi_loader.index import SlideIndex


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "export",
        help="write tiles to image folders or WebDataset tar shards",
        parents=[COMMON, TILES],
    )
    p.add_argument("index", metavar="INDEX")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument(
        "--format",
        choices=["imagefolder", "webdataset", "coords-h5"],
        help="coords-h5: one HDF5 of level-0 coordinates per slide (CLAM/TRIDENT layout)",
    )
    p.add_argument("--image-format", choices=["png", "jpeg", "webp"])
    p.add_argument("--quality", type=int, metavar="Q", help="JPEG/WebP quality")
    p.add_argument("--shard-size", type=int, metavar="N", help="tiles per shard")
    p.add_argument("--workers", type=int, metavar="N")
    p.add_argument(
        "--unit-timeout",
        type=float,
        metavar="S",
        help="give up a unit of work (a shard) not done after S seconds; the rest finishes, "
        "a rerun retries it (0: no limit)",
    )
    p.add_argument(
        "--config", metavar="FILE", help="YAML config: its export and stain sections, index root"
    )
    p.add_argument("--root", metavar="DIR", help="remap the slide root")
    p.add_argument("--split", metavar="NAME", help="export only the slides of this split")
    p.add_argument("--quarantine", metavar="FILE", help=QUARANTINE_HELP)
    p.add_argument(
        "--unlabelled-out",
        metavar="DIR",
        help="imagefolder: write tiles without a label to DIR, a folder outside --out (by "
        "default they are left out: a folder of them would be one more class to every reader)",
    )
    p.add_argument(
        "--context",
        metavar="MPP:SIZE[,MPP:SIZE]",
        help="webdataset: co-centred context tiles per sample (KEY.ctx1.jpg...); default: the "
        "index's --context; '' for none",
    )
    config_flag(
        p, "--verify", "on resume, check finished units' files by SHA-256 (not only their sizes)"
    )
    config_flag(p, "--shuffle", "mix tiles of many slides in every shard (a seeded permutation)")
    p.add_argument("--seed", type=int, metavar="N", help="seed of --shuffle (default 0)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an export in --out made from other tiles or with other arguments",
    )
    p.add_argument("--scheduler", metavar="tcp://HOST:PORT", help="run on a Dask cluster")
    p.add_argument("--no-progress", action="store_true")
    add_stain_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_loader.export._export import export_index

    config = load_config(args.config) if args.config else Config()
    flags = {
        key: getattr(args, key)
        for key in (
            "format",
            "image_format",
            "quality",
            "shard_size",
            "workers",
            "unit_timeout",
            "verify",
            "shuffle",
            "seed",
        )
        if getattr(args, key) is not None
    }
    options: ExportConfig = validate(
        ExportConfig, {**config.export.model_dump(), **flags}, "command line", "export"
    )
    _refuse_ignored(flags, options, args.scheduler)
    index = SlideIndex.open(args.index, root=args.root or config.index.root)
    context = None
    if args.context is not None:
        context = validate(DatasetConfig, {"context": args.context}, "command line").context
    with dask_client(args.scheduler) as client:
        report = export_index(
            index,
            args.out,
            **options.model_dump(),
            split=args.split,
            missing_slides=args.missing_slides,
            overwrite=args.overwrite,
            executor=client,
            progress=not args.no_progress,
            quarantine=args.quarantine or config.dataset.quarantine,
            unlabelled_out=args.unlabelled_out,
            context=context if context is not None else config.dataset.context,
            stain=stain_option(args, config.stain),
        )
    unlabelled = f", {report.unlabelled} without a label left out" if report.unlabelled else ""
    print(
        f"{report.tiles} tiles -> {args.out} ({report.failed} failed, {report.quarantined} "
        f"quarantined{unlabelled}: see failures.csv; {report.units_skipped}/{report.units} "
        "units were already complete)",
        file=sys.stderr,
    )
    return 0


def _refuse_ignored(flags: dict[str, object], options: ExportConfig, scheduler: str | None) -> None:
    """Options given on the command line that this export would silently ignore are refused,
    naming both (a config file's export section may hold values for other formats)."""

    def refuse(given: list[str], why: str) -> None:
        if given:
            names = ", ".join("--" + key.replace("_", "-") for key in given)
            raise ConfigError(f"{names} {why}", path="command line")

    if options.format == "coords-h5":
        keys = ("image_format", "quality", "shard_size", "workers", "unit_timeout", "verify")
        given = [key for key in keys if key in flags]
        refuse(given + (["scheduler"] if scheduler else []), "cannot go with --format "
               "coords-h5: it writes one file of coordinates per slide, at once, reading no "
               "pixels")  # fmt: skip
    elif scheduler:
        refuse([key for key in ("workers",) if key in flags], "cannot go with --scheduler: "
               "the Dask cluster's workers write the units (leave --workers out)")  # fmt: skip
    if options.format != "coords-h5" and options.image_format == "png":
        refuse([key for key in ("quality",) if key in flags], "is for --image-format jpeg or "
               "webp: png is lossless")  # fmt: skip
    if not options.shuffle:
        refuse([key for key in ("seed",) if key in flags], "is the seed of --shuffle, which "
               "this export does not use")  # fmt: skip
