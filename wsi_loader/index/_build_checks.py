"""What a build refuses and what it warns about, once its inputs are matched or its slides
indexed: a rebuild that would lose most slides, one slide in two splits, labels or class
names that match nothing, copies of one scan; failed slides and slides indexed with a
warning said in the log. (`_checks` is another matter: the files of a generation.)
"""

from __future__ import annotations

import logging
import os
import shlex

from wsi_loader.config import IndexConfig
from wsi_loader.errors import AnnotationError, IndexFormatError, InputError, SlideError
from wsi_loader.index._fingerprints import content_key, ends_digest
from wsi_loader.index._inputs import LabelReport
from wsi_loader.index._slide_task import SlideTask
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import CURRENT, SlideRecord
from wsi_loader.index._tissue_masks import MaskReport
from wsi_loader.index.annotations import AnnotationReport
from wsi_loader.index.annotations._formats import read_annotations

log = logging.getLogger(__name__)

FAILED_SAID = 10  # failed slides said one by one at the end of a build; the rest are counted
SHRINK_LIMIT = 0.5  # a rebuild may lose at most this share of the indexed slides unasked


def check_shrink(out: str, records: list[SlideRecord], allowed: bool) -> None:
    """Refuse a rebuild that would lose most of the slides the index has (an archive half
    unmounted, a wrong glob), unless ``allow_shrink``."""
    if allowed or not os.path.exists(os.path.join(out, CURRENT)):
        return
    try:
        before = {s.path for s in SlideIndex.open(out).slides if s.status == "ok"}
    except IndexFormatError:
        return  # an unreadable index is rebuilt
    after = {r.path for r in records if r.status == "ok"}
    lost = before - after
    if before and len(lost) > SHRINK_LIMIT * len(before):
        first = ", ".join(sorted(lost)[:3])
        raise InputError(
            f"this rebuild would drop {len(lost)} of the {len(before)} indexed slides ({first}"
            f"{', ...' if len(lost) > 3 else ''}), so {out} was left as it is; check that the "
            "inputs are all there, or pass --allow-shrink (allow_shrink=True) to accept it"
        )


def check_labels(report: LabelReport, labels: str, strict: bool) -> None:
    """Log (or with ``strict``, raise) labels rows that matched no slide and unlabelled slides."""
    problems = []
    if report.unmatched_rows:
        first = ", ".join(report.unmatched_rows[:5])
        problems.append(f"{len(report.unmatched_rows)} labels rows match no slide ({first})")
    if report.unlabelled_slides:
        first = ", ".join(os.path.basename(p) for p in report.unlabelled_slides[:5])
        problems.append(f"{len(report.unlabelled_slides)} slides have no label ({first})")
    if not problems:
        return
    if strict:
        raise InputError("; ".join(problems) + " (strict_labels is set)", path=labels)
    log.warning("%s: %s", labels, "; ".join(problems))


def say_failures(records: list[SlideRecord], out: str) -> None:
    """One WARNING per failed slide up to `FAILED_SAID`, one for the rest (an archive with
    3% unreadable slides has hundreds; `wsi-loader info DIR --failed` lists them all), and
    one per slide indexed with a warning."""
    failed = [r for r in records if r.status == "failed"]
    for record in failed[:FAILED_SAID]:
        log.warning("cannot index %s: %s", record.path, record.error)
    if len(failed) > FAILED_SAID:
        log.warning(
            "... and %d more slides could not be indexed (all of them: wsi-loader info %s "
            "--failed, or the failed records of SlideIndex.slides)",
            len(failed) - FAILED_SAID,
            shlex.quote(out),
        )
    for record in records:
        if record.status != "failed" and record.warning:
            log.warning("%s: %s", record.path, record.warning)


def check_splits(records: list[SlideRecord], root: str | None) -> None:
    """Splits are by slide: the same slide (a copy of one file under another name) in two
    splits is an error."""
    if len({r.split for r in records if r.split is not None}) < 2:
        return
    seen: dict[str, SlideRecord] = {}
    for record in records:
        if record.split is None:
            continue
        # recorded when indexed (older records lack it); by size and ends, as an object is
        key = None if record.content is None else ends_digest(record.content)
        if key is None:
            path = record.path if root is None else os.path.join(root, record.path)
            try:
                key = ends_digest(content_key(path))
            except (OSError, SlideError):
                continue
        other = seen.setdefault(key, record)
        if other.split != record.split:
            raise InputError(
                f"the same slide is in two splits: {other.path} ({other.split!r}) and "
                f"{record.path} ({record.split!r}) have identical contents"
            )


def copies(records: list[SlideRecord]) -> list[list[str]]:
    """Groups of indexed slides with identical contents (a copy, a symlink, a second
    download of one scan), and say so: each copy's tiles are in the index, so a split made
    by slide id afterwards would put the same tissue on both sides."""
    by_content: dict[str, list[str]] = {}
    for record in records:
        if record.status == "ok" and record.content is not None:
            by_content.setdefault(ends_digest(record.content), []).append(record.path)
    groups = sorted(sorted(paths) for paths in by_content.values() if len(paths) > 1)
    if groups:
        log.warning(
            "%d slides have the same contents as another (copies or links of one scan): %s. "
            "Each copy's tiles are in the index: wsi-loader split deals copies to one split, "
            "but splits given in a manifest or labels CSV must do the same (one split per "
            "group), or remove the copies",
            sum(len(group) - 1 for group in groups),
            describe_copies(groups),
        )
    return groups


def describe_copies(groups: list[list[str]], groups_shown: int = 5, names_shown: int = 3) -> str:
    """Groups of copies as one readable line: a few names of a few groups (a copied archive
    has thousands)."""

    def group_text(group: list[str]) -> str:
        more = f" and {len(group) - names_shown} more" if len(group) > names_shown else ""
        return " = ".join(group[:names_shown]) + more

    more = f"; and {len(groups) - groups_shown} more groups" if len(groups) > groups_shown else ""
    return "; ".join(group_text(group) for group in groups[:groups_shown]) + more


def warn_masks(report: MaskReport, source: str, detector: str) -> None:
    if report.unmatched_files:
        first = ", ".join(os.path.basename(f) for f in report.unmatched_files[:5])
        log.warning(
            "%s: %d tissue masks match no slide (%s)", source, len(report.unmatched_files), first
        )
    if report.slides_without:
        first = ", ".join(os.path.basename(p) for p in report.slides_without[:5])
        log.warning(
            "%d slides have no tissue mask; their tissue is found by the %s detector (%s)",
            len(report.slides_without),
            detector,
            first,
        )


def warn_dark_field(records: list[SlideRecord], forced: str) -> None:
    """Say which slides were found to be dark field (fluorescence) and had their tissue found
    by intensity: a brightfield archive with black margins would want to know."""
    if forced != "auto":
        return
    dark = [r.path for r in records if r.status == "ok" and r.tissue_detector == "fluorescence"]
    if dark:
        log.warning(
            "%d slide%s look%s dark field (fluorescence), so tissue was found by intensity "
            "instead of colour: %s%s (to find tissue by colour on them anyway, set "
            "tissue_detector: brightfield, or --tissue-detector brightfield)",
            len(dark),
            "s" if len(dark) != 1 else "",
            "" if len(dark) != 1 else "s",
            ", ".join(os.path.basename(p) for p in dark[:5]),
            ", ..." if len(dark) > 5 else "",
        )


def warn_annotations(report: AnnotationReport, source: str) -> None:
    if report.unmatched_files:
        first = ", ".join(os.path.basename(f) for f in report.unmatched_files[:5])
        log.warning(
            "%s: %d annotation files match no slide (%s)",
            source,
            len(report.unmatched_files),
            first,
        )
    if report.slides_without:
        first = ", ".join(os.path.basename(p) for p in report.slides_without[:5])
        log.warning("%d slides have no annotation file (%s)", len(report.slides_without), first)


def check_class_names(cfg: IndexConfig, tasks: list[SlideTask], carried: list[SlideRecord]) -> None:
    """A class named in an option must be in some annotation file: a typo would otherwise
    silently keep no tile (roi) or drop none (exclude). Checked before any slide is read;
    files that fail to parse fail their slide later, with the reason."""
    named = {
        "roi": cfg.roi,
        "exclude": cfg.exclude,
        "class_priority": cfg.class_priority,
        "tissue_class": [cfg.tissue_class] if cfg.tissue_class else [],
    }
    if not any(named.values()):
        return
    found: set[str] = set()
    for record in carried:
        found.update(record.class_areas or {})
    for file in sorted({f for task in tasks for f in task.annotations}):
        try:
            parsed = read_annotations(file, cfg.annotation_objects)
            found.update(shape.name for shape in parsed.shapes)
        except AnnotationError:
            continue
    for option, names in named.items():
        missing = [n for n in names if n not in found]
        if missing:
            raise InputError(
                f"{option}: no annotation file has the class(es) {missing}; the classes found "
                f"are {sorted(found) or 'none'}. Nothing was written"
            )
