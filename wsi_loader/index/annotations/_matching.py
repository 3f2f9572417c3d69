"""Which annotation files belong to which slide.

``--annotations`` names a folder (searched recursively), one file, or a CSV with ``path`` or
``slide`` and an ``annotations`` column (files relative to the CSV, ``;``-separated). In a
folder, a file matches a slide by name: ``slide.geojson``, ``slide.xml`` and HALO's
``slide.annotations`` (and QuPath's ``slide.svs.geojson``) belong to ``slide.svs``; a slide
with several files gets all of them. Where slides in different folders share a name, the
file's folders (relative to the annotations folder) decide: ``ann/a/case.geojson`` belongs to
``a/case.svs``; a file that could still belong to several slides is an error naming them.
A manifest's own ``annotations`` column comes first. Files that match no slide are reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from wsi_loader.errors import InputError
from wsi_loader.index._csv_tables import read_csv_rows
from wsi_loader.index._inputs import (
    SlideEntry,
    annotation_paths,
    name_cell,
    path_or_name,
    slide_folder,
    slide_name,
)
from wsi_loader.index.annotations._formats import ANNOTATION_SUFFIXES


@dataclass
class AnnotationReport:
    """Annotation files that matched no slide, and slides that have no annotation file."""

    unmatched_files: list[str] = field(default_factory=list)
    slides_without: list[str] = field(default_factory=list)

    def as_json(self, examples: int = 10) -> dict[str, object]:
        return {
            "unmatched_files": len(self.unmatched_files),
            "unmatched_examples": self.unmatched_files[:examples],
            "slides_without_annotations": len(self.slides_without),
            "slides_without_examples": self.slides_without[:examples],
        }


def _annotation_files(folder: str) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(
            os.path.join(dirpath, f)
            for f in sorted(filenames)
            if not f.startswith(".") and f.lower().endswith(ANNOTATION_SUFFIXES)
        )
    return found


def _keys(slide: str) -> list[str]:
    """Names an annotation file of this slide may have, without its own suffix."""
    return [os.path.basename(slide), slide_name(slide)]


def match_annotations(
    entries: list[SlideEntry], source: str | None
) -> tuple[dict[str, tuple[str, ...]], AnnotationReport]:
    """Annotation files per slide path (absolute), and the report."""
    found: dict[str, tuple[str, ...]] = {e.path: e.annotations for e in entries if e.annotations}
    report = AnnotationReport()
    if source is not None:
        if source.lower().endswith(".csv") and os.path.isfile(source):
            _from_csv(entries, source, found, report)
        elif os.path.isdir(source) or os.path.isfile(source):
            folder = os.path.abspath(source) if os.path.isdir(source) else None
            files = _annotation_files(source) if folder else [source]
            _by_path_then_name(entries, [os.path.abspath(f) for f in files], folder, found, report)
        else:
            raise InputError(
                "the annotations path does not exist (a folder, a file, or a CSV with an "
                "'annotations' column)",
                path=source,
            )
    report.slides_without = [e.path for e in entries if e.path not in found]
    if source is not None and not found:
        # an empty or wrong share would relabel every tile as background, with exit 0
        seen = report.unmatched_files
        what = (
            f"{len(seen)} annotation file(s) there, e.g. {', '.join(seen[:3])}"
            if seen
            else "no annotation file there"
        )
        raise InputError(
            f"no annotation file matches any slide ({what}; files match slides by name, "
            "'a.svs' <- 'a.geojson', 'a.xml' or 'a.annotations', or through a CSV's "
            "'annotations' column); "
            "nothing was written",
            path=source,
        )
    return found, report


def _by_path_then_name(
    entries: list[SlideEntry],
    files: list[str],
    folder: str | None,
    found: dict[str, tuple[str, ...]],
    report: AnnotationReport,
) -> None:
    """Each file to the slide it names, by relative path first: a file whose folders under
    ``folder`` end the folder path of one slide of its name is that slide's (``ann/a/case.geojson``
    belongs to ``.../a/case.svs``, not ``.../b/case.svs``). A file no slide's folders fit is
    matched by name alone, when exactly one slide has the name and no file matched that slide
    by path. A file that fits several slides equally is an `InputError` naming them."""
    by_name: dict[str, list[SlideEntry]] = {}
    for entry in entries:
        if entry.path not in found:  # a manifest's own column comes first
            for key in dict.fromkeys(_keys(entry.path)):
                by_name.setdefault(key, []).append(entry)
    mine: dict[str, list[str]] = {}
    by_name_only: list[tuple[str, list[SlideEntry]]] = []
    for file in files:
        candidates = by_name.get(Path(file).stem, [])
        folders = Path(os.path.relpath(file, folder)).parent.parts if folder else ()
        fitting = [e for e in candidates if _ends_with(slide_folder(e.path), folders)]
        if len(fitting) > 1:
            raise _ambiguous(file, fitting)
        if fitting:
            mine.setdefault(fitting[0].path, []).append(file)
        elif candidates:
            by_name_only.append((file, candidates))
    for file, candidates in by_name_only:
        if len(candidates) > 1:
            raise _ambiguous(file, candidates)
        if candidates[0].path not in mine:
            mine.setdefault(candidates[0].path, []).append(file)
    unpaired = set(files)
    for path, own in mine.items():
        found[path] = tuple(sorted(own))
        unpaired -= set(own)
    report.unmatched_files = [f for f in files if f in unpaired]


def _ends_with(parts: tuple[str, ...], tail: tuple[str, ...]) -> bool:
    return not tail or parts[-len(tail) :] == tail


def _ambiguous(file: str, slides: list[SlideEntry]) -> InputError:
    shown = ", ".join(e.path for e in slides[:5]) + (", ..." if len(slides) > 5 else "")
    return InputError(
        f"the annotation file matches {len(slides)} slides by name ({shown}): ambiguous. "
        "Put it in a folder named as its slide's folder (ann/a/case.geojson for a/case.svs), "
        "or list it in a CSV with 'path' and 'annotations' columns",
        path=file,
    )


def _from_csv(
    entries: list[SlideEntry],
    table: str,
    found: dict[str, tuple[str, ...]],
    report: AnnotationReport,
) -> None:
    folder = os.path.dirname(os.path.abspath(table))
    by_path: dict[str, tuple[str, ...]] = {}
    by_name: dict[str, tuple[str, ...]] = {}
    for line, row in read_csv_rows(table, ["path", "slide"], ("path", "slide", "annotations")):
        if "annotations" not in row:
            raise InputError("the annotations table needs an 'annotations' column", path=table)
        files = annotation_paths(row["annotations"], folder, table, line)
        if not files:
            raise InputError("empty 'annotations'", path=table, line=line)
        if row.get("path"):
            kind, key = path_or_name(folder, row["path"], table, line)
            (by_path if kind == "path" else by_name)[key] = files
        elif row.get("slide"):
            by_name[name_cell(row["slide"])] = files
        else:
            raise InputError("a row needs 'path' or 'slide'", path=table, line=line)
    named: dict[str, list[SlideEntry]] = {}  # slides a row may name (not matched by path)
    for entry in entries:
        if entry.path not in found and entry.path not in by_path:
            named.setdefault(slide_name(entry.path), []).append(entry)
    for name, slides in named.items():
        if name in by_name and len(slides) > 1:
            raise _ambiguous(";".join(by_name[name]), slides)
    used: set[str] = set()
    for entry in entries:
        if entry.path in found:
            continue
        name = slide_name(entry.path)
        hit = by_path.get(entry.path) or by_name.get(name)
        if hit:
            found[entry.path] = hit
            used.add(entry.path if entry.path in by_path else name)
    report.unmatched_files = [
        ";".join(files) for key, files in [*by_path.items(), *by_name.items()] if key not in used
    ]
