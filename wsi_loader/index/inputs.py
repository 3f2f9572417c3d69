"""Turn command-line inputs (files, folders, globs, CSV manifests) into slide entries.

A folder is searched recursively for slide files. A DICOM slide is a folder of ``.dcm``
instances: it becomes one entry (the first instance; OpenSlide finds the rest of the series).
A CSV manifest has a header with ``path`` and optionally ``label``, ``split`` and ``mpp``;
relative paths are relative to the manifest's folder. A labels CSV (``path`` or ``slide``,
plus ``label``) is joined by absolute path first, then by slide name.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from wsi_loader.errors import InputError

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


@dataclass(frozen=True)
class SlideEntry:
    """One slide to index: absolute path plus what the manifest said about it."""

    path: str
    label: str | None = None
    split: str | None = None
    mpp: float | None = None


def slide_name(path: str) -> str:
    """The name labels are joined by: the file stem, or the folder name for DICOM."""
    p = Path(path)
    return p.parent.name if p.suffix.lower() == ".dcm" else p.stem


def _scan_folder(folder: Path) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        names = sorted(f for f in filenames if not f.startswith("."))
        dicoms = [f for f in names if f.lower().endswith(".dcm")]
        if dicoms:
            found.append(os.path.join(dirpath, dicoms[0]))
        found.extend(
            os.path.join(dirpath, f)
            for f in names
            if Path(f).suffix.lower() in SLIDE_SUFFIXES and not f.lower().endswith(".dcm")
        )
    return found


def _parse_float(value: str, path: str, line: int, column: str) -> float | None:
    if not value.strip():
        return None
    try:
        number = float(value)
    except ValueError:
        raise InputError(
            f"column {column!r}: {value!r} is not a number", path=path, line=line
        ) from None
    if not number > 0:
        raise InputError(f"column {column!r}: {value!r} must be > 0", path=path, line=line)
    return number


def _read_csv(path: str, required: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            header = [h.strip() for h in (reader.fieldnames or [])]
            if not header:
                raise InputError("empty CSV (no header row)", path=path)
            if not any(col in header for col in required):
                raise InputError(
                    f"header {header} has none of the required columns {list(required)}", path=path
                )
            rows = []
            for row in reader:
                if None in row:
                    raise InputError(
                        f"{len(header) + len(row[None])} fields where the header has {len(header)}",
                        path=path,
                        line=reader.line_num,
                    )
                rows.append(
                    (reader.line_num, {k.strip(): (v or "").strip() for k, v in row.items()})
                )
            return rows
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text: {exc.reason}", path=path) from exc
    except csv.Error as exc:
        raise InputError(f"malformed CSV: {exc}", path=path) from exc
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=path) from exc


def read_manifest(path: str) -> list[SlideEntry]:
    """Entries of a ``path,label[,split][,mpp]`` manifest."""
    folder = os.path.dirname(os.path.abspath(path))
    entries: list[SlideEntry] = []
    seen: dict[str, int] = {}
    for line, row in _read_csv(path, ["path"]):
        if "path" not in row:
            raise InputError("the manifest needs a 'path' column", path=path)
        value = row["path"]
        if not value:
            raise InputError("empty 'path'", path=path, line=line)
        full = os.path.normpath(os.path.join(folder, value))
        if full in seen:
            raise InputError(
                f"{value!r} is listed twice (first on line {seen[full]})", path=path, line=line
            )
        seen[full] = line
        if os.path.isdir(full):
            dicoms = sorted(f for f in os.listdir(full) if f.lower().endswith(".dcm"))
            full = os.path.join(full, dicoms[0]) if dicoms else full
        entries.append(
            SlideEntry(
                path=full,
                label=row.get("label") or None,
                split=row.get("split") or None,
                mpp=_parse_float(row.get("mpp", ""), path, line, "mpp"),
            )
        )
    return entries


def discover(inputs: Iterable[str | os.PathLike[str]]) -> list[SlideEntry]:
    """Expand files, folders, globs and ``.csv`` manifests into unique slide entries, in order."""
    entries: dict[str, SlideEntry] = {}
    for item in inputs:
        text = os.fspath(item)
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


def join_labels(entries: list[SlideEntry], labels_csv: str) -> list[SlideEntry]:
    """Fill each entry's label (and split) from a labels CSV; manifest labels are overridden."""
    folder = os.path.dirname(os.path.abspath(labels_csv))
    by_path: dict[str, tuple[str, str | None]] = {}
    by_name: dict[str, tuple[str, str | None]] = {}
    for line, row in _read_csv(labels_csv, ["path", "slide"]):
        if "label" not in row:
            raise InputError("the labels file needs a 'label' column", path=labels_csv)
        value = (row["label"], row.get("split") or None)
        if row.get("path"):
            by_path[os.path.normpath(os.path.join(folder, row["path"]))] = value
        elif row.get("slide"):
            name = row["slide"]
            if name in by_name and by_name[name] != value:
                raise InputError(
                    f"slide {name!r} has two different labels", path=labels_csv, line=line
                )
            by_name[name] = value
        else:
            raise InputError("a row needs 'path' or 'slide'", path=labels_csv, line=line)
    out = []
    for entry in entries:
        hit = by_path.get(entry.path) or by_name.get(slide_name(entry.path))
        if hit is None and entry.path.lower().endswith(".dcm"):
            hit = by_path.get(os.path.dirname(entry.path))
        out.append(replace(entry, label=hit[0], split=hit[1] or entry.split) if hit else entry)
    return out


def fingerprint(path: str) -> tuple[int, int, str]:
    """(size, mtime_ns, digest) of a slide; the digest covers size, mtime and the first and last
    64 KiB, so a rewrite that keeps size and mtime is still noticed. DICOM covers the series
    folder. Raises OSError when the file is gone."""
    files = [path]
    if path.lower().endswith(".dcm"):
        folder = os.path.dirname(path)
        files = sorted(
            os.path.join(folder, f) for f in os.listdir(folder) if f.lower().endswith(".dcm")
        )
    digest = hashlib.blake2b(digest_size=16)
    size = mtime = 0
    for file in files:
        st = os.stat(file)
        size += st.st_size
        mtime = max(mtime, st.st_mtime_ns)
        digest.update(f"{os.path.basename(file)}:{st.st_size}:{st.st_mtime_ns};".encode())
        with open(file, "rb") as fh:
            digest.update(fh.read(65536))
            if st.st_size > 65536:
                fh.seek(max(65536, st.st_size - 65536))
                digest.update(fh.read(65536))
    return size, mtime, digest.hexdigest()
