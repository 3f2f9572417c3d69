"""The ``wsi-loader`` command: a thin layer over the library.

Exit codes: 0 success, 1 the work ran but produced nothing usable (e.g. no slide indexed),
2 usage or input errors (bad option, config, manifest or index directory).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import shlex
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from wsi_loader.config import (
    Config,
    ExportConfig,
    IndexConfig,
    load_config,
    validate,
    with_overrides,
)
from wsi_loader.errors import ConfigError, OutputError, WsiLoaderError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index.builder import describe_copies

log = logging.getLogger(__name__)


SCHEDULER_TIMEOUT_S = 10
DEFAULT_STEP_MS = 50.0  # bench --device: a mid-sized model's step per batch
MIN_THUMBNAIL = 16  # inspect --max-size below this draws nothing useful
FAILED_LISTED = 10  # index lists this many failed slides at the end; info --failed, all

_COMMON = argparse.ArgumentParser(add_help=False)
_COMMON.add_argument("-v", "--verbose", action="count", default=0, help="more log output")


def _config_flag(p: argparse.ArgumentParser, name: str, text: str) -> None:
    """A flag that sets its config key to True when given; absent, the config file decides."""
    p.add_argument(name, action="store_const", const=True, help=text)


def _names(value: str) -> list[str]:
    """A comma-separated list of class names."""
    names = [part.strip() for part in value.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no class names in {value!r}")
    return names


def _add_index(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "index",
        help="build or update a slide index",
        parents=[_COMMON],
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
    p.add_argument("--tile-size", type=int, metavar="PX", help="tile edge in output pixels")
    res = p.add_mutually_exclusive_group()
    res.add_argument("--mpp", type=float, metavar="UM_PER_PX", help="target resolution")
    res.add_argument("--level", type=int, metavar="N", help="read this level (no MPP needed)")
    p.add_argument("--mpp-tolerance", type=float, metavar="F", help="accepted relative MPP error")
    p.add_argument("--min-tissue", type=float, metavar="F", help="minimum tissue fraction 0..1")
    p.add_argument("--stride", type=int, metavar="PX", help="grid step in output pixels")
    p.add_argument("--labels", metavar="CSV", help="labels CSV joined by path or slide name")
    _config_flag(
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
        type=_names,
        metavar="C[,C]",
        help="when classes overlap on a tile, the first listed labels it (default: the "
        "smallest region on the slide)",
    )
    a.add_argument(
        "--roi", type=_names, metavar="C[,C]", help="keep only tiles inside these classes"
    )
    a.add_argument(
        "--exclude",
        type=_names,
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
        type=_names,
        metavar="T[,T]",
        help="QuPath object types read from GeoJSON exports: annotation, detection (with "
        "cells and tiles), cell, tile, tma_core (default: all; an export of all objects "
        "holds the cell detections too)",
    )
    _config_flag(p, "--allow-shrink", "let a rebuild drop more than half of the indexed slides")
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


# options of every command that reads an index
_READS = argparse.ArgumentParser(add_help=False)
_READS.add_argument("--root", metavar="DIR", help="remap the slide root")
_READS.add_argument("--split", metavar="NAME", help="only the slides of this split")
_QUARANTINE_HELP = (
    "the file failed reads are appended to and read from, instead of the index's "
    "quarantine.jsonl (an index on a read-only mount)"
)
_READS.add_argument("--quarantine", metavar="FILE", help=_QUARANTINE_HELP)

# ... of those that read tiles
_TILES = argparse.ArgumentParser(add_help=False)
_TILES.add_argument(
    "--missing-slides",
    choices=["raise", "exclude"],
    default="raise",
    help="slides that cannot be read: stop (default) or leave them out with a warning",
)


def _open_index(args: argparse.Namespace) -> SlideIndex:
    return SlideIndex.open(args.index, root=args.root, split=args.split, quarantine=args.quarantine)


def _add_info(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("info", help="summarise an index", parents=[_COMMON, _READS])
    p.add_argument("index", metavar="DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--failed", action="store_true", help="list only the slides that could not be indexed"
    )


def _add_quarantine(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "quarantine",
        help="list, clear or retry the failed reads recorded for an index",
        parents=[_COMMON],
        description="Without options: list the records (tile and slide faults).",
    )
    p.add_argument("index", metavar="DIR")
    p.add_argument("--json", action="store_true", help="print the records as one JSON array")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--clear", action="store_true", help="remove records (all, or --slide)")
    action.add_argument(
        "--retry",
        action="store_true",
        help="read quarantined tiles and slides again; keep only the records that still fail",
    )
    p.add_argument("--slide", metavar="PATH_OR_ID", help="only this slide (id, path or name)")
    p.add_argument("--root", metavar="DIR", help="remap the slide root")
    p.add_argument("--quarantine", metavar="FILE", help=_QUARANTINE_HELP)


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="write tiles to image folders or WebDataset tar shards",
        parents=[_COMMON, _TILES],
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
    p.add_argument("--config", metavar="FILE", help="YAML config: its export section, index root")
    p.add_argument("--root", metavar="DIR", help="remap the slide root")
    p.add_argument("--split", metavar="NAME", help="export only the slides of this split")
    p.add_argument("--quarantine", metavar="FILE", help=_QUARANTINE_HELP)
    _config_flag(
        p, "--verify", "on resume, check finished units' files by SHA-256 (not only their sizes)"
    )
    _config_flag(p, "--shuffle", "mix tiles of many slides in every shard (a seeded permutation)")
    p.add_argument("--seed", type=int, metavar="N", help="seed of --shuffle (default 0)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an export in --out made from other tiles or with other arguments",
    )
    p.add_argument("--scheduler", metavar="tcp://HOST:PORT", help="run on a Dask cluster")
    p.add_argument("--no-progress", action="store_true")


def _add_features(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "features",
        help="per-slide tile embeddings for MIL training (CLAM/TRIDENT h5 layout)",
        parents=[_COMMON, _READS, _TILES],
        description="Run a frozen encoder over every tile; write OUT/<slide>.h5 with features "
        "(N x D) and coords (N x 2, level-0 x, y), and OUT/features.json. Reruns skip complete "
        "slides. Under torchrun, ranks split the slides.",
    )
    p.add_argument("index", metavar="IDX")
    p.add_argument(
        "--model",
        required=True,
        metavar="SPEC",
        help="torchvision:NAME (cached weights), timm:NAME, or package.module:callable",
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
    p.add_argument("--no-progress", action="store_true")


@contextlib.contextmanager
def _dask_client(address: str | None) -> Iterator[Any]:
    """A Dask Client on ``address`` for the duration of a command (None without one)."""
    if not address:
        yield None
        return
    try:
        from dask.distributed import Client
    except ImportError as exc:
        raise ConfigError(
            "--scheduler needs dask: pip install 'wsi_loader[dask]'", path="command line"
        ) from exc
    try:
        client = Client(address, timeout=SCHEDULER_TIMEOUT_S)  # type: ignore[no-untyped-call]
    except (OSError, TimeoutError) as exc:
        raise ConfigError(
            f"cannot reach the Dask scheduler {address} within {SCHEDULER_TIMEOUT_S} s: {exc}",
            path="command line",
            key="scheduler",
            value=address,
        ) from exc
    with client:
        yield client


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="measure tile throughput on your slides and storage",
        parents=[_COMMON, _READS, _TILES],
    )
    p.add_argument("index", metavar="INDEX")
    p.add_argument("--workers", type=int, metavar="N", help="largest DataLoader worker count")
    p.add_argument("--batch-size", type=int, default=64, metavar="B")
    p.add_argument("--tiles", type=int, default=2000, metavar="N", help="tiles per measurement")
    p.add_argument("--device", metavar="D", help="also feed this device (cpu, cuda)")
    p.add_argument(
        "--step-ms",
        type=float,
        metavar="MS",
        help="with --device: simulated model step per batch (default 50)",
    )
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="measure with N other processes spinning on a core each (a busy machine)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="synthetic slides -> index -> batches, with throughput", parents=[_COMMON]
    )
    p.add_argument("--out", default="demo", metavar="DIR", help="slides and index go here")
    p.add_argument("--batches", type=int, default=40, metavar="N", help="batches to stream")


def _add_view(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect", help="draw a slide's tile grid over its thumbnail", parents=[_COMMON, _READS]
    )
    p.add_argument("index", metavar="INDEX")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument("--slide", metavar="PATH_OR_ID", help="slide id, path or name (first ok slide)")
    p.add_argument(
        "--color-by", choices=["tissue", "label", "status", "annotation"], default="tissue"
    )
    p.add_argument("--max-size", type=int, default=1024, help="longest side of the thumbnail")
    p = sub.add_parser(
        "mosaic", help="a grid of sampled tiles with captions", parents=[_COMMON, _READS]
    )
    p.add_argument("index", metavar="INDEX")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--slide", metavar="PATH_OR_ID")
    p.add_argument("--label")
    p.add_argument("--status", choices=["ok", "quarantined"])
    p.add_argument("--seed", type=int, default=0)


def _versions() -> str:
    """This package's version and those a bug report needs (the OpenSlide library too)."""
    import platform
    from importlib import metadata

    import openslide

    from wsi_loader import __version__

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    parts = [f"OpenSlide {openslide.__library_version__}"]
    parts += [f"{name} {version(name)}" for name in _REPORTED]
    parts.append(f"Python {platform.python_version()}")
    return f"wsi-loader {__version__} ({', '.join(parts)})"


_REPORTED = ("openslide-python", "tifffile", "imagecodecs", "numpy", "torch")


class _VersionAction(argparse.Action):
    """``--version``, whose versions are looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(_versions())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wsi-loader",
        description="Whole-slide image tiles for training: build a tile index of an archive, "
        "inspect it, stream or export its tiles, extract per-slide features.",
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="show the versions a bug report needs and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_index(sub)
    _add_info(sub)
    _add_quarantine(sub)
    _add_view(sub)
    _add_export(sub)
    _add_features(sub)
    _add_bench(sub)
    _add_demo(sub)
    return parser


def _annotations_line(report: dict[str, Any]) -> str:
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


def cmd_index(args: argparse.Namespace) -> int:
    config = load_config(args.config).index if args.config else IndexConfig()
    overrides: dict[str, Any] = {
        key: getattr(args, key)
        for key in (
            "tile_size",
            "mpp",
            "level",
            "mpp_tolerance",
            "min_tissue",
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
        )
    }
    config = with_overrides(config, source="command line", **overrides)
    with _dask_client(args.scheduler) as client:
        index = build_index(
            args.paths, args.out, config, progress=not args.no_progress, executor=client
        )
    ok = [s for s in index.slides if s.status == "ok"]
    failed = len(index.slides) - len(ok)
    build = index.meta.get("build") or {}
    done = f"{build.get('indexed', len(index.slides))} indexed"
    if build.get("unchanged"):
        done = f"{build['unchanged']} unchanged, {done}"
    print(
        f"{len(index.slides)} slides ({len(ok)} ok, {failed} failed; {done}), {len(index)} "
        f"tiles -> {args.out}",
        file=sys.stderr,
    )
    for s in [s for s in index.slides if s.status == "failed"][:FAILED_LISTED]:
        print(f"  failed: {one_line(s.path)}: {one_line(s.error)}", file=sys.stderr)
    if failed > FAILED_LISTED:  # each was also logged as it failed; info lists them all
        print(
            f"  ... and {failed - FAILED_LISTED} more failed slides: "
            f"wsi-loader info {shlex.quote(str(args.out))} --failed",
            file=sys.stderr,
        )
    report = index.meta.get("labels_report")
    if report:
        print(_labels_line(report), file=sys.stderr)
    annotated = index.meta.get("annotations_report")
    if annotated:
        print(_annotations_line(annotated), file=sys.stderr)
    if not ok:
        print("error: no slide could be indexed", file=sys.stderr)
        return 1
    return 0


def _labels_line(report: dict[str, Any]) -> str:
    """One line on how the labels CSV matched (counts and first names)."""
    parts = []
    for key, what in (
        ("unmatched", "labels rows match no slide"),
        ("unlabelled", "slides have no label"),
    ):
        count = report[f"{key}_rows" if key == "unmatched" else f"{key}_slides"]
        if count:
            first = ", ".join(
                one_line(os.path.basename(str(n))) for n in report[f"{key}_examples"][:3]
            )
            parts.append(f"{count} {what} ({first}{', ...' if count > 3 else ''})")
    return "labels: " + ("; ".join(parts) if parts else "every slide matched a labels row")


def _counts_line(counts: dict[str, dict[str, int]], shown: int = 12) -> str:
    """'normal: 3 slides / 102 tiles, tumour: 1 slide / 34 tiles' (the first ``shown``)."""
    parts = [
        f"{name}: {c['slides']} slide{'s' * (c['slides'] != 1)} / {c['tiles']} tiles"
        for name, c in list(counts.items())[:shown]
    ]
    more = f" and {len(counts) - shown} more" if len(counts) > shown else ""
    return ", ".join(parts) + more


# C0 and C1 control characters: from a slide name or a label they could drive the terminal
# (escape sequences that clear it, retitle it, or rewrite what was printed)
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")
_CONTROLS_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escaped(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]  # '\x1b', '\n'


def one_line(text: object) -> str:
    """``text`` with every control character escaped: a value inside a line of output."""
    return _CONTROLS.sub(_escaped, str(text))


def printable(text: str) -> str:
    """``text`` with control characters escaped but its line and tab breaks kept."""
    return _CONTROLS_BUT_LINES.sub(_escaped, text)


class _PrintableFormatter(logging.Formatter):
    """Log lines whose untrusted parts (slide names, labels) cannot drive the terminal, nor
    start a line that looks like another record: a message is one line (its newlines
    escaped); a traceback (``-v``) keeps its line breaks."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return one_line(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def _human_summary(summary: dict[str, Any], only_failed: bool = False) -> str:
    slides = summary["slides"]
    ok = sum(s["status"] == "ok" for s in slides)
    q = summary["quarantine"]
    split = f", split {summary['split']!r}" if summary["split"] else ""
    lines = [
        f"index {summary['path']} (schema {summary['schema_version']}, "
        f"{summary['generation']}{split})",
        f"{len(slides)} slides ({ok} ok, {len(slides) - ok} failed), {summary['tiles']} tiles; "
        f"quarantine: {q['tiles']} tile and {q['slides']} slide records",
    ]
    unit = "tiles" if summary["label_from"] == "annotations" else "slides"
    if summary["label_counts"]:
        lines.append("classes: " + _counts_line(summary["label_counts"]))
    if summary["splits"]:
        lines.append(
            "splits: "
            + ", ".join(
                f"{name} {c['slides']} slides / {c['tiles']} tiles"
                + (
                    f" ({', '.join(f'{label}: {n[unit]}' for label, n in c['labels'].items())})"
                    if c["labels"]
                    else ""
                )
                for name, c in sorted(summary["splits"].items())
            )
        )
    if summary["labels_report"]:
        lines.append(_labels_line(summary["labels_report"]))
    if summary["label_names"]:
        from_notes = summary["label_from"] == "annotations"
        source = " (tile labels, from the annotations)" if from_notes else ""
        ids = ", ".join(f"{i} = {name}" for i, name in enumerate(summary["label_names"]))
        lines.append(f"label ids{source}: {ids}")
    if summary["copies"]:
        extra = sum(len(group) - 1 for group in summary["copies"])
        lines.append(
            f"copies: {extra} slide{' has' if extra == 1 else 's have'} the same contents as "
            "another: " + describe_copies(summary["copies"])
        )
    lines.append(f"{'id':>4} {'status':7} {'tiles':>7} {'mpp':>7} {'level':>5} {'label':12} path")
    for s in slides:
        if only_failed and s["status"] != "failed":
            continue
        mpp = f"{s['mpp']:.3f}" if s["mpp"] else "-"
        level = "-" if s["read_level"] is None else str(s["read_level"])
        lines.append(
            f"{s['slide_id']:>4} {s['status']:7} {s['tiles']:>7} {mpp:>7} {level:>5} "
            f"{one_line(s['label'] or '-')[:12]:12} {one_line(s['path'])}"
        )
        if s["error"]:
            lines.append(f"{'':>4} error: {one_line(s['error'])}")
        if s["warning"]:
            lines.append(f"{'':>4} warning: {one_line(s['warning'])}")
    return printable("\n".join(lines))


def cmd_info(args: argparse.Namespace) -> int:
    summary = _open_index(args).summary()
    if args.json:
        if args.failed:
            summary["slides"] = [s for s in summary["slides"] if s["status"] == "failed"]
        print(json.dumps(summary, indent=1))
    else:
        print(_human_summary(summary, only_failed=args.failed))
    return 0


def cmd_quarantine(args: argparse.Namespace) -> int:
    from wsi_loader.dataset.quarantine import clear, retry, select

    index = SlideIndex.open(args.index, root=args.root, quarantine=args.quarantine)
    if args.clear:
        kept, removed = clear(index, args.slide)
        print(f"removed {removed} records, {kept} left", file=sys.stderr)
        return 0
    if args.retry:
        kept, removed = retry(index, args.slide)
        print(f"{removed} records cleared (they read fine now), {kept} still fail", file=sys.stderr)
        return 0
    records = select(index, args.slide)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    for r in records:
        where = "whole slide" if r.get("kind") == "slide" else f"x={r['x']} y={r['y']}"
        print(
            f"{r.get('kind', 'tile'):5} {one_line(r['path'])} {where}: {one_line(r.get('error'))}"
        )
    tiles = sum(r.get("kind", "tile") == "tile" for r in records)
    print(f"{tiles} tile and {len(records) - tiles} slide records", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from wsi_loader.export import export_index

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
    index = SlideIndex.open(args.index, root=args.root or config.index.root)
    with _dask_client(args.scheduler) as client:
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
        )
    print(
        f"{report.tiles} tiles -> {args.out} ({report.failed} failed, {report.quarantined} "
        f"quarantined: see failures.csv; {report.units_skipped}/{report.units} units were "
        "already complete)",
        file=sys.stderr,
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from wsi_loader.bench import format_table, run_bench
    from wsi_loader.dataset.loader import default_workers

    top = default_workers() if args.workers is None else args.workers
    if top < 0 or args.batch_size < 1 or args.tiles < 1:
        raise ConfigError(
            "--workers must be >= 0, --batch-size and --tiles >= 1", path="command line"
        )
    if args.step_ms is not None and (args.device is None or args.step_ms < 0):
        raise ConfigError(
            "--step-ms is the model step of --device, in milliseconds >= 0",
            path="command line",
        )
    from wsi_loader.index.health import require_slides

    index = require_slides(_open_index(args), args.missing_slides)
    result = run_bench(
        index,
        tiles=args.tiles,
        batch_size=args.batch_size,
        workers=sorted({0, *range(1, top + 1)}),
        device=args.device,
        step_ms=DEFAULT_STEP_MS if args.step_ms is None else args.step_ms,
        busy=args.busy,
    )
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from wsi_loader.demo import run

    run(args.out, batches=args.batches)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from wsi_loader.view import SlideOverview

    if args.max_size < MIN_THUMBNAIL:
        raise ConfigError(
            f"--max-size must be at least {MIN_THUMBNAIL} pixels, got {args.max_size}",
            path="command line",
            key="max_size",
            value=args.max_size,
        )
    index = _open_index(args)
    overview = SlideOverview(index, args.slide, color_by=args.color_by, max_size=args.max_size)
    overview.save(args.out)
    print(
        f"{args.out}: {len(overview.cells)} tiles of "
        f"{one_line(index.slides[overview.slide_id].path)}",
        file=sys.stderr,
    )
    return 0


def cmd_mosaic(args: argparse.Namespace) -> int:
    from wsi_loader.view import Mosaic

    index = _open_index(args)
    mosaic = Mosaic(
        index, args.n, slide=args.slide, label=args.label, status=args.status, seed=args.seed
    )
    mosaic.save(args.out)
    print(
        f"{args.out}: {len(mosaic.rows)} tiles ({int((~mosaic.ok).sum())} failed to read)",
        file=sys.stderr,
    )
    return 0


def cmd_features(args: argparse.Namespace) -> int:
    from wsi_loader.features import extract

    # `--model mymodels:encoder` finds mymodels.py in the current folder, as `python -m` would
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    _init_distributed()
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
    )
    print(
        f"{report.tiles} tiles of {report.written} slides -> {args.out} ({report.skipped} slides "
        f"already complete, {report.failed} tiles failed: see features.json)",
        file=sys.stderr,
    )
    if report.incomplete:
        for entry in report.incomplete:
            print(
                f"  not written: {one_line(entry['slide'])}: {one_line(entry['reason'])}",
                file=sys.stderr,
            )
        print("error: some slides could not be read; run the command again", file=sys.stderr)
        return 1
    return 0


def _init_distributed() -> None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


COMMANDS = {
    "index": cmd_index,
    "info": cmd_info,
    "quarantine": cmd_quarantine,
    "inspect": cmd_inspect,
    "mosaic": cmd_mosaic,
    "export": cmd_export,
    "features": cmd_features,
    "bench": cmd_bench,
    "demo": cmd_demo,
}


def _details(args: argparse.Namespace) -> None:
    """With -v, the traceback of the error about to be reported in one line."""
    if args.verbose:
        traceback.print_exc()


def main(argv: Sequence[str] | None = None) -> int:
    # slide paths that are not UTF-8 (held as lone surrogates) print as their own bytes, as
    # ls prints them, instead of failing the command in a UTF-8 locale
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="surrogateescape")
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), handlers=[handler])
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        # the reader went away (`wsi-loader info idx | head -1`): end quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OutputError as exc:  # a full disk: finished work is kept (written atomically)
        _details(args)
        print(
            f"error: {printable(str(exc))}. What was finished is kept: make room (or fix the "
            "folder) and run the same command again",
            file=sys.stderr,
        )
        return 1
    except (WsiLoaderError, ValueError) as exc:  # ValueError: an option the library rejected
        _details(args)
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine, not the data: a folder that went away, a full disk
        _details(args)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {printable(f'{where}{exc.strerror or exc}')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
