"""`wsi-loader info`: summarise an index (a table, or --json)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from wsi_loader.cli.common import (
    COMMON,
    READS,
    Subparsers,
    counts_line,
    labels_line,
    not_he_text,
    one_line,
    open_index,
    printable,
    qc_counts_text,
)
from wsi_loader.index._build_checks import describe_copies
from wsi_loader.index._health import problem_kind, slide_problems


def register(sub: Subparsers) -> None:
    p = sub.add_parser("info", help="summarise an index", parents=[COMMON, READS])
    p.add_argument("index", metavar="DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--failed", action="store_true", help="list only the slides that could not be indexed"
    )
    p.epilog = (
        "Each indexed slide is checked (one stat, or one request for objects in a store): "
        "one deleted since shows as missing, one rewritten or truncated as changed."
    )
    p.set_defaults(run=run)


def _state(slide: dict[str, Any]) -> str:
    """A slide's status as indexed, or what is wrong with it now (missing, changed...)."""
    problem = slide.get("problem")
    return str(slide["status"]) if problem is None else problem_kind(problem)


def _vector(values: list[float]) -> str:
    return "(" + ", ".join(f"{v:.2f}" for v in values) + ")"


def human_summary(summary: dict[str, Any], only_failed: bool = False) -> str:
    slides = summary["slides"]
    states = Counter(_state(s) for s in slides)
    now = "".join(f", {states[k]} {k}" for k in ("missing", "changed", "unreadable") if states[k])
    q = summary["quarantine"]
    split = f", split {summary['split']!r}" if summary["split"] else ""
    lines = [
        f"index {summary['path']} (schema {summary['schema_version']}, "
        f"{summary['generation']}{split})",
        f"{len(slides)} slides ({states['ok']} ok, {states['failed']} failed{now}), "
        f"{summary['tiles']} tiles; quarantine: {q['tiles']} tile and {q['slides']} slide "
        "records",
    ]
    context = (summary.get("params") or {}).get("context")
    if context:  # what datasets of this index read beside each tile by default
        lines.append(
            "context: " + ", ".join(f"{size} px at {mpp:g} um/px" for mpp, size in context)
        )
    unit = "tiles" if summary["label_from"] == "annotations" else "slides"
    if summary["label_counts"]:
        lines.append("classes: " + counts_line(summary["label_counts"]))
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
        lines.append(labels_line(summary["labels_report"]))
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
    stain = summary.get("stain") or {}
    if stain.get("reference"):
        ref = stain["reference"]
        lines.append(
            f"stain: {stain['estimated']} of {sum(s['status'] == 'ok' for s in slides)} slides "
            f"estimated; median H {_vector(ref['H'])} "
            f"E {_vector(ref['E'])} (wsi-loader stain)" + not_he_text(stain.get("not_he"), "; ")
        )
    if summary.get("qc"):
        lines.append(qc_summary_line(summary["qc"], summary["tiles"]))
    lines.append(
        f"{'id':>4} {'status':7} {'tiles':>7} {'tile_mpp':>8} {'mag':>5} {'level':>5} "
        f"{'scan_mpp':>8} {'label':12} path"
    )
    for s in slides:
        if only_failed and s["status"] != "failed":
            continue
        # the tiles' resolution (what a model sees), then the scan's level 0
        tile_mpp = f"{s['tile_mpp']:.3f}" if s.get("tile_mpp") else "-"
        scan_mpp = f"{s['mpp']:.3f}" if s["mpp"] else "-"
        mag = f"{s['tile_mag']:.3g}x" if s.get("tile_mag") else "-"
        level = "-" if s["read_level"] is None else str(s["read_level"])
        lines.append(
            f"{s['slide_id']:>4} {_state(s):7} {s['tiles']:>7} {tile_mpp:>8} {mag:>5} "
            f"{level:>5} {scan_mpp:>8} {one_line(s['label'] or '-')[:12]:12} "
            f"{one_line(s['path'])}"
        )
        if s["error"]:
            lines.append(f"{'':>4} error: {one_line(s['error'])}")
        if s.get("problem"):
            lines.append(f"{'':>4} problem: {one_line(s['problem'])}")
        if s["warning"]:
            lines.append(f"{'':>4} warning: {one_line(s['warning'])}")
        if s.get("stain_error") and s["status"] == "ok" and s["tiles"]:
            lines.append(f"{'':>4} no stain estimate: {one_line(s['stain_error'])}")
        if s.get("tissue_detector") not in (None, "brightfield"):
            why = f" ({one_line(s['tissue_reason'])})" if s.get("tissue_reason") else ""
            lines.append(f"{'':>4} tissue: {s['tissue_detector']}{why}")
        qc = s.get("qc")
        if qc and (qc["any"] or qc["excluded"]):
            counts = qc_counts_text(qc, qc["excluded"], s["tiles"], "qc_exclude")
            lines.append(f"{'':>4} qc: {counts}")
    return printable("\n".join(lines))


def qc_summary_line(totals: dict[str, Any], tiles: int) -> str:
    limits = ", ".join(
        f"{name} {'<' if name == 'blur' else '>='} {value:g}"
        for name, value in totals["thresholds"].items()
    )
    counts = qc_counts_text(totals["flagged"], totals["excluded"], tiles, "qc_exclude")
    return f"quality control ({limits}): {counts}"


def run(args: argparse.Namespace) -> int:
    index = open_index(args)
    summary = index.summary()
    # whether the indexed slides are still there as indexed: a stat each (a request each,
    # concurrent, for objects in a store)
    indexed = [s["slide_id"] for s in summary["slides"] if s["status"] == "ok"]
    problems = slide_problems(index, indexed)
    for s in summary["slides"]:
        s["problem"] = problems.get(s["slide_id"])
    if args.json:
        if args.failed:
            summary["slides"] = [s for s in summary["slides"] if s["status"] == "failed"]
        print(json.dumps(summary, indent=1))
    else:
        print(human_summary(summary, only_failed=args.failed))
    return 0
