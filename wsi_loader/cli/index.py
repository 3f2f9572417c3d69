"""`wsi-loader index`: build or update a slide index."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from wsi_loader.cli.common import (
    COMMON,
    Subparsers,
    class_names,
    config_flag,
    dask_client,
    labels_line,
    magnification_arg,
    not_he_text,
    one_line,
    qc_counts_text,
    ray_executor,
)
from wsi_loader.config import IndexConfig, load_config, with_overrides
from wsi_loader.errors import ConfigError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index._qc import RULES, check_rule


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "index",
        help="build or update a slide index",
        parents=[COMMON],
        description="Find tissue, lay a tile grid and record tile coordinates.",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="slide files, folders (searched recursively), globs or CSV manifests",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="index directory")
    p.add_argument("--config", metavar="FILE", help="YAML config (see configs/index.yaml)")
    add_grid_options(p)
    p.add_argument(
        "--for-encoder",
        metavar="NAME",
        help="default --mpp and --tile-size to the resolution and patch size the encoder NAME "
        "was trained at (wsi-loader encoders)",
    )
    p.add_argument("--mpp-tolerance", type=float, metavar="F", help="accepted relative MPP error")
    p.add_argument(
        "--context",
        metavar="MPP:SIZE[,MPP:SIZE]",
        help="co-centred context tiles that datasets of this index read by default beside each "
        "tile (e.g. 2.0:224); slides that cannot serve them fail",
    )
    p.add_argument("--stride", type=int, metavar="PX", help="grid step in output pixels")
    p.add_argument("--labels", metavar="CSV", help="labels CSV joined by path or slide name")
    config_flag(
        p, "--strict-labels", "labels rows matching no slide, or slides without a label, are errors"
    )
    p.add_argument("--root", metavar="DIR", help="store slide paths relative to this folder")
    a = p.add_argument_group(
        "region annotations (QuPath GeoJSON, ASAP, Aperio or HALO XML, Digital Slide Archive "
        "JSON; level-0 pixels)"
    )
    a.add_argument(
        "--annotations",
        metavar="PATH",
        help="a folder or file matched to slides by name (slide.svs <- slide.geojson / "
        "slide.xml / slide.annotations), or a CSV with path|slide and 'annotations' columns",
    )
    a.add_argument(
        "--label-from",
        choices=["slides", "annotations"],
        help="a tile's label: its slide's (default) or the annotated class covering it",
    )
    a.add_argument(
        "--min-coverage",
        type=float,
        metavar="F",
        help="share of a tile a class must cover to label it, or to be in --roi (0.5)",
    )
    a.add_argument(
        "--background-label",
        metavar="NAME",
        help="label of tiles no class covers enough (default: unlabelled, -1)",
    )
    a.add_argument(
        "--class-priority",
        type=class_names,
        metavar="C[,C]",
        help="when classes overlap on a tile, the first listed labels it (default: the "
        "smallest region on the slide)",
    )
    a.add_argument(
        "--roi", type=class_names, metavar="C[,C]", help="keep only tiles inside these classes"
    )
    a.add_argument(
        "--exclude",
        type=class_names,
        metavar="C[,C]",
        help="drop tiles overlapping these classes (pen marks, folds)",
    )
    a.add_argument(
        "--max-excluded",
        type=float,
        metavar="F",
        help="share of an --exclude class a kept tile may overlap (0: any overlap drops it)",
    )
    a.add_argument(
        "--annotation-objects",
        type=class_names,
        metavar="T[,T]",
        help="QuPath object types read from GeoJSON exports: annotation, detection (with "
        "cells and tiles), cell, tile, tma_core (default: all; an export of all objects "
        "holds the cell detections too)",
    )
    t = p.add_argument_group("tissue detection and quality control")
    t.add_argument(
        "--tissue-detector",
        choices=["auto", "brightfield", "fluorescence"],
        help="how tissue is found: per slide from its picture (auto: dark field -> "
        "fluorescence, by intensity; else brightfield, by colour), or this one for all",
    )
    t.add_argument(
        "--tissue-masks",
        metavar="PATH",
        help="tissue mask images (white = tissue): a folder or file matched by slide name "
        "(slide.svs <- slide.png, slide_mask.tif...), or a CSV with path|slide and mask",
    )
    t.add_argument(
        "--tissue-class",
        metavar="NAME",
        help="an annotation class (from --annotations) that is the tissue",
    )
    t.add_argument(
        "--qc",
        choices=["all", "none"],
        help="quality-control columns qc_focus, qc_pen, qc_fold, qc_bubble, qc_background "
        "(all, the default; none: not measured, no cost)",
    )
    t.add_argument(
        "--qc-exclude",
        type=qc_rules,
        metavar="RULE[,RULE]",
        help="drop the tiles these rules flag: pen, blur, fold, bubble",
    )
    t.add_argument(
        "--qc-threshold",
        type=qc_threshold,
        action="append",
        metavar="RULE=V",
        help="a rule's threshold (repeatable): pen/fold/bubble flag a share >= V (defaults "
        f"{RULES['pen'].threshold:g}/{RULES['fold'].threshold:g}/{RULES['bubble'].threshold:g}"
        f"), blur a focus < V ({RULES['blur'].threshold:g} of the slide's typical tissue)",
    )
    config_flag(p, "--allow-shrink", "let a rebuild drop more than half of the indexed slides")
    p.add_argument("--workers", type=int, metavar="N", help="parallel slide workers")
    p.add_argument(
        "--slide-timeout",
        type=float,
        metavar="S",
        help="give up a slide not done after S seconds (recorded as failed; 0: no limit)",
    )
    p.add_argument("--backend", choices=["auto", "openslide", "tiff"])
    p.add_argument(
        "--no-align",
        dest="align_to_storage",
        action="store_const",
        const=False,
        help="centre the grid instead of starting it on storage-tile corners",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--scheduler",
        metavar="tcp://HOST:PORT",
        help="run on a Dask distributed cluster (pip install 'wsi_loader[dask]')",
    )
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run on a Ray cluster: HOST:PORT of its head, or 'auto' (pip install "
        "'wsi_loader[ray]')",
    )
    p.set_defaults(run=run)


GRID_KEYS = ("tile_size", "mpp", "level", "mag", "min_tissue")


def add_grid_options(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The tile grid's options (`GRID_KEYS`): `index`'s, and those of `predict` and `features`
    when they index slides on the way (`cli/_index_on_the_way.py`)."""
    p.add_argument("--tile-size", type=int, metavar="PX", help="tile edge in output pixels")
    res = p.add_mutually_exclusive_group()
    res.add_argument("--mpp", type=float, metavar="UM_PER_PX", help="target resolution")
    res.add_argument("--level", type=int, metavar="N", help="read this level (no MPP needed)")
    res.add_argument(
        "--mag",
        type=magnification_arg,
        metavar="X",
        help="target magnification (20, 20x or 40X): the slide's objective power / X is the "
        "downsample; slides stating none use mpp = 10 / X",
    )
    p.add_argument("--min-tissue", type=float, metavar="F", help="minimum tissue fraction 0..1")


def qc_rules(value: str) -> list[str]:
    """``pen,blur`` as QC rule names."""
    names = class_names(value)
    for name in names:
        try:
            check_rule(name)
        except ConfigError as exc:  # names the close rule
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def qc_threshold(value: str) -> tuple[str, float]:
    """``blur=0.4`` as (rule, threshold)."""
    name, sep, number = value.partition("=")
    name = name.strip()
    if not sep:
        raise argparse.ArgumentTypeError(
            f"expected RULE=VALUE with a rule among {', '.join(RULES)}, got {value!r}"
        )
    try:
        check_rule(name)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        return name, float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number in {value!r}") from None


def qc_line(totals: dict[str, Any] | None, tiles: int) -> str | None:
    """What quality control left out and flagged over the index (``totals``: the ``qc`` of
    its `SlideIndex.summary`), in one line."""
    if totals is None:
        return None
    counts = qc_counts_text(totals["flagged"], totals["excluded"], tiles, "--qc-exclude")
    return f"quality control: {counts}"


def _encoder_defaults(args: argparse.Namespace) -> None:
    """--for-encoder NAME: the encoder's training resolution and patch size, where the
    command line gives none (a resolution: --mpp, --level or --mag)."""
    from wsi_loader.models._encoder_recipes import ALIASES, ENCODERS

    name = ALIASES.get(args.for_encoder.lower(), args.for_encoder.lower())
    if name not in ENCODERS:
        raise ConfigError(
            f"no encoder {args.for_encoder!r}; `wsi-loader encoders` lists them",
            key="for_encoder",
            value=args.for_encoder,
        )
    recipe = ENCODERS[name]
    if args.mpp is None and args.level is None and args.mag is None:
        args.mpp = recipe.mpp
    if args.tile_size is None:
        args.tile_size = recipe.patch_size


def annotations_line(report: dict[str, Any]) -> str:
    classes = report.get("classes") or {}
    parts = [
        f"{one_line(name)} ({entry['slides']} slides, {entry['tiles_labelled']} tiles labelled)"
        for name, entry in classes.items()
    ]
    line = f"annotation classes: {', '.join(parts) or 'none'}"
    if report.get("unmatched_files"):
        line += f"; {report['unmatched_files']} annotation files matched no slide"
    if report.get("slides_without_annotations"):
        line += f"; {report['slides_without_annotations']} slides have no annotation file"
    return line


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config).index if args.config else IndexConfig()
    if args.for_encoder:
        _encoder_defaults(args)
    overrides: dict[str, Any] = {
        key: getattr(args, key)
        for key in (
            *GRID_KEYS,
            "context",
            "mpp_tolerance",
            "stride",
            "labels",
            "strict_labels",
            "allow_shrink",
            "root",
            "workers",
            "slide_timeout",
            "backend",
            "align_to_storage",
            "annotations",
            "label_from",
            "min_coverage",
            "background_label",
            "class_priority",
            "roi",
            "exclude",
            "max_excluded",
            "annotation_objects",
            "tissue_detector",
            "tissue_masks",
            "tissue_class",
            "qc",
            "qc_exclude",
        )
    }
    if args.qc_threshold:
        overrides["qc_thresholds"] = {**config.qc_thresholds, **dict(args.qc_threshold)}
    config = with_overrides(config, source="command line", **overrides)
    if args.scheduler and args.ray:
        raise ConfigError(
            "give --scheduler (Dask) or --ray, not both", path="command line", key="ray"
        )
    if args.workers is not None and (args.scheduler or args.ray):
        raise ConfigError(
            f"--workers cannot go with {'--scheduler' if args.scheduler else '--ray'}: the "
            "cluster's workers index the slides (leave --workers out)",
            path="command line",
            key="workers",
        )
    with dask_client(args.scheduler) as client, ray_executor(args.ray) as on_ray:
        index = build_index(
            args.paths,
            args.out,
            config,
            progress=not args.no_progress,
            executor=client if on_ray is None else on_ray,
        )
    ok = [s for s in index.slides if s.status == "ok"]
    failed = len(index.slides) - len(ok)
    build = index.meta.get("build") or {}
    done = f"{build.get('indexed', len(index.slides))} indexed"
    if build.get("unchanged"):
        done = f"{build['unchanged']} unchanged, {done}"
    # the failed slides and their reasons were said by the build's warnings, once
    print(
        f"{len(index.slides)} slides ({len(ok)} ok, {failed} failed; {done}), {len(index)} "
        f"tiles -> {args.out}",
        file=sys.stderr,
    )
    report = index.meta.get("labels_report")
    if report:
        print(labels_line(report), file=sys.stderr)
    annotated = index.meta.get("annotations_report")
    if annotated:
        print(annotations_line(annotated), file=sys.stderr)
    summary = index.summary()  # reads every slide's records: once
    checked = qc_line(summary["qc"], len(index))
    if checked:
        print(checked, file=sys.stderr)
    other_stains = not_he_text(summary["stain"]["not_he"])
    if other_stains:  # normalisation and QC assume H&E; each slide's warning says why
        print(
            f"stain: {other_stains}: IHC, Giemsa...? (each slide's warning says why)",
            file=sys.stderr,
        )
    # an index without a tile trains nothing, whether its slides failed or gave no tile:
    # an error either way (the index is written, so `info` can show each slide)
    if not ok:
        print("error: no slide could be indexed", file=sys.stderr)
        return 1
    if len(index) == 0:
        print(f"error: no tile could be indexed ({no_tile_counts(index)})", file=sys.stderr)
        return 1
    return 0


def no_tile_counts(index: SlideIndex) -> str:
    """How the slides of an index without a tile ended, counted (their reasons were said
    once each, by the build's warnings)."""
    failed = sum(s.status != "ok" for s in index.slides)
    empty = len(index.slides) - failed
    parts = [
        f"{n} slide{'s' if n != 1 else ''} {what}"
        for n, what in (
            (failed, "failed"),
            (empty, "has no tile" if empty == 1 else "have no tile"),
        )
        if n
    ]
    return f"{', '.join(parts)}; each slide's reason is in the warnings above"
