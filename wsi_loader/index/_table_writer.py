"""Writing an index: a new generation, made current atomically (the files: `_table_files`),
one build at a time per folder.

A build writes a new generation under a temporary name, renames it, then swaps ``CURRENT``:
a build killed at any point leaves the previous index readable. Older generations are deleted
only when no process holds their ``readers.lock``, so a dataset pickled to a worker (which
reopens its generation by name) keeps working across an in-place rebuild.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from wsi_loader.errors import IndexFormatError
from wsi_loader.files import lock
from wsi_loader.index._labels import label_order
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import (
    CURRENT,
    OPTIONAL_COLUMNS,
    READERS_LOCK,
    SCHEMA_VERSION,
    TILE_COLUMNS,
    SlideRecord,
    TileArrays,
    current_generation,
)

log = logging.getLogger(__name__)

BUILD_LOCK = "build.lock"


def _unused(gen: Path) -> bool:
    """True when no process holds ``gen``'s readers lock (or it has none)."""
    try:
        fd = os.open(gen / READERS_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, gen / READERS_LOCK)  # no locks: no way to know
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@contextmanager
def exclusive_build(out: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``DIR/build.lock`` for one build: a second build into the same folder fails at
    once with "another build is running" instead of racing the first (its temporary
    generation removed under it)."""
    base = Path(out)
    if base.exists() and not base.is_dir():
        raise IndexFormatError("the index output exists and is not a folder", path=str(base))
    created = not base.exists()
    try:
        base.mkdir(parents=True, exist_ok=True)
        fd = os.open(base / BUILD_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise IndexFormatError(
            f"cannot write the index folder: {exc.strerror}", path=str(base)
        ) from exc
    try:
        try:
            lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, base / BUILD_LOCK)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            raise IndexFormatError(
                f"another build is running into this index (pid {holder}); wait for it to finish",
                path=str(base),
            ) from None
        try:  # who holds the lock, for the message above; a full disk fails the build later
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            log.debug("cannot record the build's pid in %s: %s", base / BUILD_LOCK, exc)
        try:
            yield
        except BaseException:
            if created and not (base / CURRENT).exists():  # a failed first build leaves nothing
                shutil.rmtree(base, ignore_errors=True)
            raise
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _no_partial_generation(out: str | os.PathLike[str]) -> Iterator[None]:
    """A write that fails (a full disk, an interrupt) removes its partial generation, which
    holds disk space; a system error becomes `IndexFormatError` with the reason."""
    try:
        yield
    except BaseException as exc:
        for partial in Path(out).glob(f".gen-*.tmp-{os.getpid()}"):
            shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(exc, OSError):
            raise
        raise IndexFormatError(
            f"cannot write the index: {exc.strerror or exc}; the previous index (if any) is "
            "unchanged: make room and run the same command again",
            path=os.fspath(out),
        ) from exc


def write_index(
    out: str | os.PathLike[str],
    slides: Sequence[SlideRecord],
    tiles: Sequence[TileArrays],
    params: Mapping[str, Any],
    root: str | None,
    extra_meta: Mapping[str, Any] | None = None,
) -> SlideIndex:
    """Write a new generation atomically. ``tiles[i]`` holds slide i's columns (any length).

    A write that fails (a full disk) leaves the previous generation current and no partial
    one behind, and raises `IndexFormatError` with the reason."""
    with _no_partial_generation(out):
        base = Path(out)
        name = _write_generation(base, slides, tiles, params, root, extra_meta)
        _remove_stale(base, keep=name)
        return SlideIndex.open(base)


def _write_generation(
    base: Path,
    slides: Sequence[SlideRecord],
    tiles: Sequence[TileArrays],
    params: Mapping[str, Any],
    root: str | None,
    extra_meta: Mapping[str, Any] | None,
) -> str:
    """`write_index`'s work: the new generation, made current; returns its name."""
    base.mkdir(parents=True, exist_ok=True)
    previous = None
    if (base / CURRENT).exists():
        previous = current_generation(base).name
    number = int(previous.split("-")[1]) + 1 if previous else 1
    name = f"gen-{number:06d}"
    tmp = base / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / READERS_LOCK).touch()

    records, first = [], 0
    for record, arrays in zip(slides, tiles, strict=True):
        count = len(arrays["l0_x"]) if arrays else 0
        records.append(asdict(record) | {"tiles": count, "first_row": first})
        first += count
    labels = label_order(
        r["label"] for r in records if r["label"] is not None and r["status"] == "ok"
    )
    # optional columns are written when every slide has them (the builder sees to that)
    optional = {
        name: dtype
        for name, dtype in OPTIONAL_COLUMNS.items()
        if tiles and all(name in t for t in tiles)
    }
    written = {**TILE_COLUMNS, **optional}
    for col, dtype in written.items():
        parts = [np.asarray(t[col], dtype=dtype) for t in tiles if t]
        array = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        with open(tmp / f"{col}.npy", "wb") as fh:
            np.save(fh, array)
            fh.flush()
            os.fsync(fh.fileno())
    meta = {
        "schema_version": SCHEMA_VERSION,
        "generation": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "params": dict(params),
        "root": root,
        "slides_total": len(records),
        "tiles_total": first,
        "label_names": labels,
        "slide_label_names": labels,
        "columns": {k: str(v) for k, v in written.items()},
        **(extra_meta or {}),
    }
    for file, payload in (("slides.json", records), ("meta.json", meta)):
        with open(tmp / file, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    os.rename(tmp, base / name)
    pointer_tmp = base / f".{CURRENT}.tmp-{os.getpid()}"
    pointer_tmp.write_text(name + "\n", encoding="utf-8")
    os.replace(pointer_tmp, base / CURRENT)
    _fsync_dir(base)
    return name


def _remove_stale(base: Path, keep: str) -> None:
    """Delete older generations no process uses any more, and leftovers of killed builds."""
    for entry in base.iterdir():
        if entry.name == keep or not entry.is_dir():
            continue
        if entry.name.startswith("gen-"):
            if _unused(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                log.info("keeping %s: a process still reads it", entry)
        elif entry.name.startswith(".gen-"):
            shutil.rmtree(entry, ignore_errors=True)


def split_tiles(index: SlideIndex, slide_id: int) -> TileArrays:
    """Copy one slide's rows out of an index (used to carry unchanged slides over)."""
    record = index.slides[slide_id]
    rows = slice(record.first_row, record.first_row + record.tiles)
    return {name: np.array(col[rows]) for name, col in index.columns.items()}


def records_by_path(index: SlideIndex) -> dict[str, tuple[int, SlideRecord]]:
    return {r.path: (i, r) for i, r in enumerate(index.slides)}
