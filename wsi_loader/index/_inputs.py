"""Turn command-line inputs (files, folders, globs, CSV manifests) into slide entries.

A folder is searched recursively for slide files. A DICOM slide is a folder of DICOM
instances (found by their ``DICM`` preamble, whatever their extension: ``.dcm``, ``.dicom`` or
none): it becomes one entry (the first instance; OpenSlide finds the rest of the series).
A CSV manifest has a header with ``path`` and optionally ``label``, ``split``, ``patient``
(or ``patient_id``, ``case_id``: a patient's slides stay in one split), ``mpp`` and
``annotations`` (annotation files of the slide, ``;``-separated);
relative paths are relative to the manifest's folder ('\\' separates folders in those
written on Windows). A labels CSV (``path`` or ``slide``,
plus ``label``) is joined by absolute path first, then by slide name.

URLs (``s3://bucket/prefix``, ``gs://...``, ``https://...``) work wherever a path does: a
prefix is listed (recursively) like a folder, a URL glob is expanded, manifests may name URLs
(or be URLs themselves: their relative paths are then relative to the manifest's URL folder).
``file://`` URLs are local paths.
"""

from __future__ import annotations

import glob
import math
import os
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path, PureWindowsPath

from wsi_loader.errors import InputError
from wsi_loader.index._csv_tables import read_csv_rows, read_csv_table
from wsi_loader.slides._base import MIN_PLAUSIBLE_MPP
from wsi_loader.slides.storage._sources import is_url, list_objects, local_path, url_join

SLIDE_SUFFIXES = frozenset(
    {
        ".svs",
        ".tif",
        ".tiff",
        ".ndpi",
        ".vms",
        ".vmu",
        ".scn",
        ".mrxs",
        ".bif",
        ".svslide",
        ".qptiff",
        ".dcm",
    }
)
_GLOB_CHARS = set("*?[")
# a slide's patient: CLAM's tables say case_id, spreadsheets patient or patient_id
PATIENT_COLUMNS = ("patient", "patient_id", "case_id")
MANIFEST_COLUMNS = ("path", "label", "split", *PATIENT_COLUMNS, "mpp", "annotations")
LABELS_COLUMNS = ("path", "slide", "label", "split", *PATIENT_COLUMNS)
_DECIMAL_COMMA = re.compile(r"[+-]?\d*,\d+")
_WINDOWS_ABSOLUTE = re.compile(r"[A-Za-z]:[\\/]|\\\\")
DICOM_SUFFIXES = frozenset({".dcm", ".dicom"})
# a DICOM file: a 128-byte preamble, then these four bytes (PS3.10 section 7.1)
DICOM_MAGIC_OFFSET, DICOM_MAGIC = 128, b"DICM"


def is_dicom(path: str) -> bool:
    """True when ``path`` is a DICOM file (by its preamble; unreadable files are not, and
    neither is anything but a regular file: opening a FIFO would block). URLs: by name."""
    if is_url(path):
        return is_dicom_name(path)
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as fh:
            fh.seek(DICOM_MAGIC_OFFSET)
            return fh.read(4) == DICOM_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class SlideEntry:
    """One slide to index: absolute path plus what the manifest said about it."""

    path: str
    label: str | None = None
    split: str | None = None
    patient: str | None = None  # the ``patient`` or ``case_id`` column
    mpp: float | None = None
    annotations: tuple[str, ...] = ()  # the manifest's ``annotations`` column (absolute paths)


@dataclass
class LabelReport:
    """How a labels CSV matched the slides: rows that matched no slide, slides left unlabelled
    (names; the counts are the lengths)."""

    unmatched_rows: list[str] = field(default_factory=list)
    unlabelled_slides: list[str] = field(default_factory=list)

    def as_json(self, examples: int = 10) -> dict[str, object]:
        return {
            "unmatched_rows": len(self.unmatched_rows),
            "unmatched_examples": self.unmatched_rows[:examples],
            "unlabelled_slides": len(self.unlabelled_slides),
            "unlabelled_examples": self.unlabelled_slides[:examples],
        }


def is_dicom_name(path: str) -> bool:
    return Path(path).suffix.lower() in DICOM_SUFFIXES


def name_cell(value: str) -> str:
    """A table's slide-name cell as a slide name: a file name (``a.b.svs``, as ls or TRIDENT
    list slides) loses its slide suffix; other dots (``case.1.2``) are part of the name."""
    suffix = Path(value).suffix
    return value[: -len(suffix)] if suffix and suffix.lower() in SLIDE_SUFFIXES else value


def slide_name(path: str) -> str:
    """The name labels are joined by: the file stem, or the folder name for DICOM."""
    p = Path(path)
    return p.parent.name if is_dicom_name(path) or is_dicom(path) else p.stem


def slide_folder(path: str) -> tuple[str, ...]:
    """The folders a slide is in, as path parts (a DICOM slide: those of its series folder,
    whose name is the slide's name)."""
    p = Path(path)
    return (p.parent.parent if is_dicom_name(path) or is_dicom(path) else p.parent).parts


def _scan_folder(folder: Path) -> list[str]:
    """Slide files under ``folder``; symlinked sub-folders are followed, each real folder once
    (a link back up the tree is not a loop)."""
    found: list[str] = []
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        names = sorted(f for f in filenames if not f.startswith("."))
        slides, dicoms = [], []
        for f in names:
            full = os.path.join(dirpath, f)
            suffix = Path(f).suffix.lower()
            if suffix in DICOM_SUFFIXES or (suffix not in SLIDE_SUFFIXES and is_dicom(full)):
                dicoms.append(full)
            elif suffix in SLIDE_SUFFIXES:
                slides.append(full)
        if dicoms:
            found.append(dicoms[0])
        found.extend(slides)
    return found


def dicom_series_files(path: str) -> list[str]:
    """The DICOM instances in the folder of ``path`` (a slide's whole series)."""
    folder = os.path.dirname(path)
    return sorted(
        os.path.join(folder, f)
        for f in os.listdir(folder)
        if not f.startswith(".")
        and os.path.isfile(os.path.join(folder, f))
        and (is_dicom_name(f) or is_dicom(os.path.join(folder, f)))
    )


def _parse_float(
    value: str, path: str, line: int, column: str, decimal_comma: bool = False
) -> float | None:
    """A positive number; with ``decimal_comma`` (a ';' or tab separated file, as spreadsheets
    in many locales write them) '0,25' is 0.25. Thousands separators are refused."""
    if not value.strip():
        return None
    text = value.strip()
    if decimal_comma and _DECIMAL_COMMA.fullmatch(text):
        text = text.replace(",", ".")
    try:
        number = float(text)
    except ValueError:
        raise InputError(
            f"column {column!r}: {value!r} is not a number", path=path, line=line
        ) from None
    if not math.isfinite(number):
        raise InputError(
            f"column {column!r}: {value!r} is not a finite number", path=path, line=line
        )
    if not number > 0:
        raise InputError(f"column {column!r}: {value!r} must be > 0", path=path, line=line)
    return number


MAX_MANIFEST_MPP = 1000.0  # as the index's own target (IndexConfig.mpp)


def _parse_mpp(value: str, path: str, line: int, decimal_comma: bool) -> float | None:
    """A manifest's MPP: used as given (it overrides the slide's metadata), so one that is
    no light microscope's (a typo, another unit) is an error here, not a slide indexed at a
    resolution 100 times off."""
    mpp = _parse_float(value, path, line, "mpp", decimal_comma)
    if mpp is not None and mpp < MIN_PLAUSIBLE_MPP:
        raise InputError(
            f"column 'mpp': {mpp:g} um/px is finer than a light microscope resolves (under "
            f"{MIN_PLAUSIBLE_MPP:g}); give microns per pixel, e.g. 0.25 for a 40x scan",
            path=path,
            line=line,
        )
    if mpp is not None and mpp > MAX_MANIFEST_MPP:
        raise InputError(
            f"column 'mpp': {mpp:g} um/px is coarser than {MAX_MANIFEST_MPP:g}; give microns "
            "per pixel, e.g. 0.25 for a 40x scan",
            path=path,
            line=line,
        )
    return mpp


def _windows_absolute(value: str) -> bool:
    """``C:\\x``, ``C:/x`` or ``\\\\server\\share``: a path no POSIX machine can open."""
    return os.sep == "/" and _WINDOWS_ABSOLUTE.match(value) is not None


def _resolve(folder: str, value: str, table: str, line: int) -> str:
    """A manifest's path cell: a URL as it is, else relative to the manifest's folder. On
    POSIX, '\\' in a relative path (a CSV written on Windows) separates folders unless a
    file is named with it; a Windows absolute path is an error naming the row."""
    value = local_path(value)
    if is_url(value) or is_url(folder):
        return url_join(folder, value)
    full = os.path.normpath(os.path.join(folder, value))
    written_on_windows = os.sep == "/" and ("\\" in value or _windows_absolute(value))
    if not written_on_windows or os.path.lexists(full):
        return full
    if _windows_absolute(value):
        raise InputError(
            f"{value!r} is a Windows path, which cannot be opened here: list slides "
            "relative to the manifest's folder (slides\\a.svs works) or by their path on "
            "this machine",
            path=table,
            line=line,
        )
    return os.path.normpath(os.path.join(folder, value.replace("\\", "/")))


def patient_cell(row: dict[str, str], path: str, line: int) -> str | None:
    """A row's patient: its ``patient``, ``patient_id`` or ``case_id`` cell (those given must
    agree)."""
    given = {name: row[name] for name in PATIENT_COLUMNS if row.get(name)}
    if len(set(given.values())) > 1:
        said = " and ".join(f"{name!r} {value!r}" for name, value in given.items())
        raise InputError(
            f"{said} differ (they name one thing: give one of them)", path=path, line=line
        )
    return next(iter(given.values()), None)


def _folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if is_url(path) else os.path.dirname(os.path.abspath(path))


def read_manifest(path: str) -> list[SlideEntry]:
    """Entries of a ``path,label[,split][,mpp]`` manifest."""
    folder = _folder_of(path)
    entries: list[SlideEntry] = []
    seen: dict[str, int] = {}
    table = read_csv_table(path, ["path"], MANIFEST_COLUMNS)
    for line, row in table.rows:
        if "path" not in row:
            raise InputError("the manifest needs a 'path' column", path=path)
        value = row["path"]
        if not value:
            raise InputError("empty 'path'", path=path, line=line)
        full = _resolve(folder, value, path, line)
        if full in seen:
            raise InputError(
                f"{value!r} is listed twice (first on line {seen[full]})", path=path, line=line
            )
        seen[full] = line
        if not is_url(full) and os.path.isdir(full):
            dicoms = dicom_series_files(os.path.join(full, "_"))
            full = dicoms[0] if dicoms else full
        entries.append(
            SlideEntry(
                path=full,
                label=row.get("label") or None,
                split=row.get("split") or None,
                patient=patient_cell(row, path, line),
                mpp=_parse_mpp(row.get("mpp", ""), path, line, table.delimiter != ","),
                annotations=annotation_paths(row.get("annotations", ""), folder, path, line),
            )
        )
    return entries


def path_or_name(folder: str, value: str, table: str, line: int) -> tuple[str, str]:
    """A table's ``path`` cell as ``("path", absolute path)``, or as ``("slide", name)`` when it
    is a Windows absolute path (a table written on Windows: its folders mean nothing here,
    its file names do)."""
    if _windows_absolute(value) and not os.path.lexists(os.path.join(folder, value)):
        return "slide", slide_name(PureWindowsPath(value).as_posix())
    return "path", _resolve(folder, value, table, line)


def annotation_paths(value: str, folder: str, table: str, line: int) -> tuple[str, ...]:
    """A manifest cell naming annotation files (several separated by ``;``), relative to the
    manifest's folder (``table``, whose ``line`` errors name)."""
    parts = [part.strip() for part in value.split(";") if part.strip()]
    return tuple(_resolve(folder, part, table, line) for part in parts)


def discover(inputs: Iterable[str | os.PathLike[str]]) -> list[SlideEntry]:
    """Expand files, folders, globs and ``.csv`` manifests into unique slide entries, in order."""
    entries: dict[str, SlideEntry] = {}
    for item in inputs:
        text = local_path(os.fspath(item))
        if is_url(text):
            if text.lower().endswith(".csv"):
                for entry in read_manifest(text):
                    entries.setdefault(entry.path, entry)
                continue
            if Path(text).suffix.lower() in SLIDE_SUFFIXES and not _GLOB_CHARS & set(text):
                urls = [text]  # one object (a missing one is recorded as failed)
            else:
                urls = list_objects(text, SLIDE_SUFFIXES)
                if not urls:
                    raise InputError(f"no slide objects under {text!r}")
            for url in urls:
                entries.setdefault(url, SlideEntry(path=url))
            continue
        if text.lower().endswith(".csv") and os.path.isfile(text):
            for entry in read_manifest(text):
                entries.setdefault(entry.path, entry)
            continue
        if os.path.isdir(text):
            paths = _scan_folder(Path(text))
        elif not os.path.exists(text) and _GLOB_CHARS & set(text):
            paths = sorted(
                p
                for p in glob.glob(text, recursive=True)
                if os.path.isfile(p) and Path(p).suffix.lower() in SLIDE_SUFFIXES
            )
            if not paths:
                raise InputError(f"the pattern {text!r} matches no slide files")
        else:
            paths = [text]  # a file, or a missing one: recorded as failed by the builder
        for p in paths:
            full = os.path.abspath(p)
            entries.setdefault(full, SlideEntry(path=full))
    return list(entries.values())


def join_labels(entries: list[SlideEntry], labels_csv: str) -> tuple[list[SlideEntry], LabelReport]:
    """Fill each entry's label (and split, patient) from a labels CSV; manifest labels are
    overridden.

    Returns the entries and a `LabelReport` (rows that matched no slide, slides left without a
    label: in neither the labels CSV nor the manifest). A row with an empty label, or a slide
    given two different labels or splits, is an `InputError`.
    """
    folder = _folder_of(labels_csv)
    by_path: dict[str, tuple[str, str | None, str | None]] = {}
    by_name: dict[str, tuple[str, str | None, str | None]] = {}
    row_name: dict[tuple[str, str], str] = {}
    for line, row in read_csv_rows(labels_csv, ["path", "slide"], LABELS_COLUMNS):
        if "label" not in row:
            raise InputError("the labels file needs a 'label' column", path=labels_csv)
        if not row["label"]:
            raise InputError(
                "empty label (leave the slide out of the labels file instead)",
                path=labels_csv,
                line=line,
            )
        value = (row["label"], row.get("split") or None, patient_cell(row, labels_csv, line))
        if row.get("path"):
            kind, key = path_or_name(folder, row["path"], labels_csv, line)
            table, shown = (by_path if kind == "path" else by_name), row["path"]
        elif row.get("slide"):
            table, key, shown = by_name, name_cell(row["slide"]), row["slide"]
        else:
            raise InputError("a row needs 'path' or 'slide'", path=labels_csv, line=line)
        key = unicodedata.normalize("NFC", key)  # a Mac's NFD file names match NFC text
        if key in table and table[key] != value:
            raise InputError(
                f"slide {shown!r} is given two different labels, splits or patients "
                f"({table[key]} and {value})",
                path=labels_csv,
                line=line,
            )
        table[key] = value
        row_name[("path" if table is by_path else "slide", key)] = shown
    out, used, report = [], set(), LabelReport()
    for entry in entries:
        candidates = [("path", entry.path), ("slide", slide_name(entry.path))]
        if is_dicom_name(entry.path) or is_dicom(entry.path):
            candidates.insert(1, ("path", os.path.dirname(entry.path)))
        hit = None
        for kind, written in candidates:
            table = by_path if kind == "path" else by_name
            key = unicodedata.normalize("NFC", written)
            if key in table:
                hit = table[key]
                used.add((kind, key))
                break
        if hit is None and entry.label is None:  # a manifest's label stays the label
            report.unlabelled_slides.append(entry.path)
        out.append(
            replace(
                entry, label=hit[0], split=hit[1] or entry.split, patient=hit[2] or entry.patient
            )
            if hit
            else entry
        )
    report.unmatched_rows = [name for key, name in row_name.items() if key not in used]
    return out, report
