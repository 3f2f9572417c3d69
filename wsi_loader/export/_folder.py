"""What an export's folder holds besides its tiles, and what a rerun makes of it.

Bookkeeping lives in hidden plain files of the output root (never folders: torchvision's
ImageFolder and Hugging Face's imagefolder take every folder of the root for a class):

* ``.export-settings.json``: the arguments, the export layout version and a digest of what the
  export holds (`unit_contents`). A rerun with the same ones resumes; other ones are refused
  (`check_destination`) unless ``overwrite`` (`clear_export`).
* ``.export-plan.npz``: which index rows, in which order, and which were left out and why.
* ``.export-parts.jsonl``: one record per finished unit (its manifest rows and the files it
  wrote, with sizes and SHA-256), appended under a lock by `_unit._append_part`. A unit counts
  as done while its files are intact (`outputs_intact`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from wsi_loader.errors import ConfigError
from wsi_loader.export._card import CARD_FILE, is_ours
from wsi_loader.files import lock
from wsi_loader.index._fingerprints import slide_version
from wsi_loader.index._table import SlideIndex

PARTS_FILE = ".export-parts.jsonl"  # one record per finished unit, appended under a lock
SETTINGS_FILE = ".export-settings.json"
LOCK_FILE = ".export-lock"  # held (flock) by the export writing the folder
PLAN_FILE = ".export-plan.npz"


def part_records(out: Path) -> dict[int, dict[str, Any]]:
    """The last record of every unit in the parts file (torn lines skipped)."""
    try:
        raw = (out / PARTS_FILE).read_bytes()
    except FileNotFoundError:
        return {}
    records: dict[int, dict[str, Any]] = {}
    for line in raw.splitlines():
        try:
            record = json.loads(line)
            records[int(record["unit"])] = record
        except (ValueError, KeyError, TypeError):
            continue
    return records


def outputs_intact(out: Path, record: dict[str, Any], verify: bool) -> bool:
    """Whether every file a unit wrote is there with its recorded size (and hash)."""
    for name, size, digest in record.get("outputs", []):
        path = out / name
        try:
            if path.stat().st_size != size:
                return False
        except OSError:
            return False
        if verify and hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return False
    return True


def relative_name(path: Path, out: Path) -> str:
    """``path`` relative to the export's root (``../`` for tiles kept in unlabelled_out)."""
    return Path(os.path.relpath(path, out)).as_posix()


@contextmanager
def held(out: Path) -> Iterator[None]:
    """Hold ``out`` for one export (its `LOCK_FILE` locked) for the block: a second export
    into it (``--overwrite`` would clear the first's finished units mid-run) is refused. The
    folder is created for the lock file, which the export's readers do not see (hidden)."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        try:
            lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, out / LOCK_FILE)
        except BlockingIOError:
            raise ConfigError(
                f"another export is writing {out}: wait for it, or write elsewhere",
                path=str(out),
            ) from None
        yield
    finally:
        os.close(fd)


def read_settings(out: Path) -> dict[str, Any] | None:
    """The settings of the export in ``out`` (None for an empty or missing folder)."""
    if not out.exists() or not any(p.name != LOCK_FILE for p in out.iterdir()):
        return None
    source = out / SETTINGS_FILE
    if not source.exists():
        raise ConfigError(
            f"{out} is not empty and holds no export; choose an empty folder", path=str(out)
        )
    try:
        previous = json.loads(source.read_text(encoding="utf-8"))
        if not isinstance(previous, dict):
            raise ValueError("no settings object")
        if isinstance(previous.get("stain"), str):  # older exports: the stain as a JSON string
            previous["stain"] = json.loads(previous["stain"])
    except (OSError, ValueError) as exc:  # includes UnicodeDecodeError
        raise ConfigError(
            f"{source} is unreadable ({exc}); it was not written by a finished export step: "
            "delete the folder, or choose another one",
            path=str(source),
        ) from exc
    return previous


def check_destination(out: Path, settings: dict[str, Any]) -> bool:
    """Refuse a folder holding another export; True when it holds this one (a resume)."""
    previous = read_settings(out)
    if previous is None:
        return False
    mine = {k: v for k, v in settings.items() if k != "content"}
    theirs = {k: v for k, v in previous.items() if k != "content"}
    if theirs.get("version") != mine["version"]:
        raise ConfigError(
            f"{out} holds an export made by another version of wsi_loader (layout "
            f"{theirs.get('version')}, this one writes {mine['version']}): use --overwrite "
            "(overwrite=True) to replace it, or an empty folder",
            path=str(out),
        )
    if theirs != mine:
        changed = sorted(k for k in mine if theirs.get(k) != mine.get(k))
        raise ConfigError(
            f"{out} holds an export made with different arguments ({', '.join(changed)}); "
            "use the same arguments to resume, --overwrite to replace it, or an empty folder",
            path=str(out),
        )
    return True


def clear_export(out: Path) -> None:
    """Remove an export's files from ``out`` (the outputs its records list, its manifests and
    bookkeeping), for --overwrite; nothing else in the folder is touched."""
    outside: set[Path] = set()  # unlabelled_out
    for record in part_records(out).values():
        for name, _, _ in record.get("outputs", []):
            (out / name).unlink(missing_ok=True)
            if name.startswith("../"):
                outside.add((out / name).parent)
    for name in (PARTS_FILE, SETTINGS_FILE, PLAN_FILE, "manifest.csv", "failures.csv"):
        (out / name).unlink(missing_ok=True)
    (out / "export.json").unlink(missing_ok=True)
    if is_ours(out):
        (out / CARD_FILE).unlink(missing_ok=True)
    for folder in sorted(out.rglob("*"), reverse=True):  # class folders left empty
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    for folder in outside:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def slide_keys(index: SlideIndex) -> np.ndarray:
    """A 64-bit identity per slide: stored path, label and split."""
    keys = [
        int.from_bytes(
            hashlib.blake2b(
                f"{s.path}\0{s.label}\0{s.split}".encode("utf-8", "surrogateescape"),
                digest_size=8,
            ).digest(),
            "little",
        )
        for s in index.slides
    ]
    return np.array(keys, dtype=np.uint64)


def unit_contents(full: SlideIndex, order: np.ndarray, shard_size: int) -> list[str] | None:
    """A digest of what each unit holds (each row's slide, x, y, level, window size, label),
    from the generation ``full``; None when the plan's rows no longer exist in it."""
    if len(order) and int(order.max()) >= len(full):
        return None
    cols = full.columns
    keys = slide_keys(full)
    columns = [
        keys[cols["slide_id"][order]].view(np.int64),
        np.asarray(cols["l0_x"][order], np.int64),
        np.asarray(cols["l0_y"][order], np.int64),
        np.asarray(cols["level"][order], np.int64),
        np.asarray(cols["read_size"][order], np.int64),
    ]
    if full.labels_from_annotations:  # tiles relabelled go to other folders: other contents
        columns.append(full.tile_labels(order))
    table = np.stack(columns, axis=1)
    return [
        hashlib.blake2b(table[start : start + shard_size].tobytes(), digest_size=16).hexdigest()
        for start in range(0, len(order), shard_size)
    ]


def unit_slides(full: SlideIndex, order: np.ndarray, shard_size: int) -> list[str]:
    """A digest per unit of the slides its rows are read from, by content (`slide_version`):
    a slide rewritten since a unit was written (a tile re-encoded, the index rebuilt) makes
    the unit run again; a slide only touched or copied does not."""
    versions = [slide_version(s.path, s.content, s.fingerprint) or "" for s in full.slides]
    ids = np.asarray(full.columns["slide_id"][order], np.int64)
    digests = []
    for start in range(0, len(order), shard_size):
        slides = np.unique(ids[start : start + shard_size]).tolist()
        text = json.dumps([[full.slides[i].path, versions[i]] for i in slides])
        digests.append(hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=16))
    return [d.hexdigest() for d in digests]


def unlabelled_folder(
    unlabelled_out: str | os.PathLike[str] | None, out: Path, format: str
) -> Path | None:
    """The resolved ``unlabelled_out``, checked: an image-folder export's, outside ``out``
    (every folder inside is a class to the readers)."""
    if unlabelled_out is None:
        return None
    if format != "imagefolder":
        raise ConfigError(
            f"unlabelled_out (--unlabelled-out) is for imagefolder exports; a {format} export "
            "keeps tiles without a label, with label null",
            key="unlabelled_out",
            value=str(unlabelled_out),
        )
    folder = Path(unlabelled_out).resolve()
    root = out.resolve()
    if folder == root or root in folder.parents:
        raise ConfigError(
            f"unlabelled_out {folder} is inside the export {root}, where every folder is a "
            "class to torchvision's ImageFolder and Hugging Face's imagefolder: choose a folder "
            "outside it",
            key="unlabelled_out",
            value=str(unlabelled_out),
        )
    return folder


def remove_partial_files(out: Path, unlabelled_out: Path | None = None) -> None:
    """Delete temporary files a killed export left behind (never under a final name)."""
    for folder in (out, unlabelled_out):
        if folder is None or not folder.exists():
            continue
        for path in folder.rglob(".*.tmp-*"):
            if path.is_file() and re.search(r"\.tmp-\d+$", path.name):
                path.unlink()
