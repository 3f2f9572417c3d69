"""`wsi-loader split`: assign an index's slides to train/val/test, or to k folds, by patient."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from dataclasses import replace
from typing import Any

from wsi_loader.cli.common import COMMON, Subparsers, one_line
from wsi_loader.index import SlideIndex
from wsi_loader.index._splits import SplitPlan, no_tiles, patients, stored_plan, write_splits


def share(value: str) -> float:
    """A share in [0, 1)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 <= number < 1:
        raise argparse.ArgumentTypeError(f"a share is in [0, 1), got {value}")
    return number


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "split",
        help="assign the slides to train/val/test or k folds, keeping each patient in one",
        parents=[COMMON],
        description="Deal whole patients (or slides) to train/val/test, or to K folds beside "
        "a test split, stratified by label, the same for the same seed. The index gets a new "
        "generation whose slides carry their split: --split train (and foldN:train, "
        "foldN:val, test with --folds) selects them in every command. Slides with no tiles are "
        "left out of the dealing: they get no split, and a warning names them.",
        epilog="A slide's patient is the 'patient' (or 'case_id') column of the manifest or "
        "labels CSV it was indexed with, else the case of its TCGA barcode name "
        "(TCGA-CR-7395-01A-01-TS1 -> TCGA-CR-7395), else the slide is its own patient.",
    )
    p.add_argument("index", metavar="DIR")
    p.add_argument(
        "--folds",
        type=int,
        metavar="K",
        help="K > 1: folds fold1..foldK beside the test split; round N trains on foldN:train "
        "and validates on foldN:val (default 1: one train/val/test split)",
    )
    p.add_argument(
        "--by",
        choices=["patient", "slide"],
        help="what is dealt whole (default: patient)",
    )
    p.add_argument(
        "--stratify",
        choices=["label", "none"],
        help="keep each label's share alike in every split (label: every slide needs one)",
    )
    p.add_argument("--seed", type=int, help="the same seed, the same splits (0)")
    p.add_argument("--test", type=share, metavar="F", help="test share (0.2)")
    p.add_argument("--val", type=share, metavar="F", help="validation share without --folds (0.2)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="deal every slide again (without it, an index with splits keeps them and only "
        "its slides without a split are dealt, under the options it was split with)",
    )
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    p.set_defaults(run=run)


def counts(index: SlideIndex) -> dict[str, dict[str, object]]:
    """Per split: patients (as they were dealt: a copy of a scan is its original's), slides,
    tiles and slides per label."""
    out: dict[str, dict[str, object]] = {}
    members: dict[str, set[str]] = defaultdict(set)
    for record, patient in zip(index.slides, patients(index.slides), strict=True):
        if record.split is None:
            continue
        entry = out.setdefault(record.split, {"patients": 0, "slides": 0, "tiles": 0, "labels": {}})
        entry["slides"] = int(str(entry["slides"])) + 1
        entry["tiles"] = int(str(entry["tiles"])) + record.tiles
        labels = entry["labels"]
        assert isinstance(labels, dict)
        name = record.label or "(none)"
        labels[name] = labels.get(name, 0) + 1
        members[record.split].add(str(patient))
    for name, entry in out.items():
        entry["patients"] = len(members[name])
    return dict(sorted(out.items()))


def _plan(args: argparse.Namespace, index: SlideIndex) -> SplitPlan | None:
    """The plan the options give, laid over the plan the index was split with when its
    splits are kept; None when no option is given (`write_splits` picks it)."""
    options = {"by": args.by, "folds": args.folds, "test": args.test, "val": args.val}
    given: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    if args.seed is not None:
        given["seed"] = args.seed
    if args.stratify is not None:
        given["stratify"] = None if args.stratify == "none" else "label"
    if not given:
        return None
    stored = None if args.overwrite else stored_plan(index)
    base = stored or SplitPlan(stratify=None)
    folds = given.get("folds", base.folds)
    if stored is None or folds != base.folds:  # the default val of that many folds
        given.setdefault("val", 0.2 if folds == 1 else 0.0)
    return replace(base, **given)


def run(args: argparse.Namespace) -> int:
    opened = SlideIndex.open(args.index)
    before = {s.path: s.split for s in opened.slides}
    index = write_splits(args.index, _plan(args, opened), overwrite=args.overwrite)
    plan = stored_plan(index)
    found = counts(index)
    assigned = Counter(
        s.split for s in index.slides if s.split is not None and before.get(s.path) is None
    )
    kept = sum(split is not None for split in before.values()) if not args.overwrite else 0
    if args.json:
        print(
            json.dumps(
                {
                    "plan": plan.as_json() if plan else None,
                    "splits": found,
                    "assigned": dict(sorted(assigned.items())),
                    "kept": kept,
                    "no_tiles": no_tiles(index.slides),
                },
                indent=1,
            )
        )
        return 0
    if kept and not assigned:
        print(
            f"every indexed slide has a split already ({kept} slides): nothing assigned; "
            "--overwrite deals them all again",
            file=sys.stderr,
        )
    elif kept:
        dealt = ", ".join(f"{name} {n}" for name, n in sorted(assigned.items()))
        print(
            f"assigned {sum(assigned.values())} slides without a split ({dealt}); the "
            f"{kept} slides with one kept theirs",
            file=sys.stderr,
        )
    for name, entry in found.items():
        labels = entry["labels"]
        assert isinstance(labels, dict)
        shown = ", ".join(f"{one_line(label)} {n}" for label, n in sorted(labels.items()))
        print(
            f"{name}: {entry['patients']} patients, {entry['slides']} slides, "
            f"{entry['tiles']} tiles ({shown})"
        )
    left = no_tiles(index.slides)
    if left:
        print(f"no split: {len(left)} slides with no tiles (left out of the dealing)")
    folds = plan.folds if plan else 1
    if folds > 1:
        print(
            f"select round N with --split foldN:train and --split foldN:val (N = 1..{folds})"
            + (", the held-out slides with --split test" if "test" in found else ""),
            file=sys.stderr,
        )
    return 0
