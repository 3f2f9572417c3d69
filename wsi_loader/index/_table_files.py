"""The on-disk format of an index: its directory layout, the tile columns and their dtypes,
the slide record, and reading a generation's files (``CURRENT``, memory-mapped columns, the
readers lock).

Layout of an index directory::

    DIR/CURRENT              name of the live generation, replaced atomically
    DIR/gen-000003/meta.json schema_version, build parameters, counts, label names, root
    DIR/gen-000003/slides.json one record per slide (slide id = position)
    DIR/gen-000003/<column>.npy one array per tile column (see TILE_COLUMNS)
    DIR/gen-000003/readers.lock every process using the generation holds a shared flock on it
    DIR/quarantine.jsonl     failed reads appended by datasets (outlives generations)

Tiles of one slide are contiguous (``SlideRecord.first_row``), in row-major grid order.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import IndexFormatError
from wsi_loader.files import lock
from wsi_loader.index._qc import QC_COLUMNS

SCHEMA_VERSION = 1
CURRENT = "CURRENT"
READERS_LOCK = "readers.lock"

# name -> dtype of every tile column; all have one row per tile.
TILE_COLUMNS: dict[str, np.dtype[Any]] = {
    "slide_id": np.dtype(np.int32),  # position in the slide table
    "l0_x": np.dtype(np.int32),  # level-0 top-left x
    "l0_y": np.dtype(np.int32),  # level-0 top-left y
    "level": np.dtype(np.int16),  # read level
    "read_size": np.dtype(np.int32),  # window edge in read-level pixels (l_w == l_h)
    "tissue": np.dtype(np.float32),  # tissue fraction from the mask, 0..1
}
# Columns of annotated indexes only (built with annotations).
OPTIONAL_COLUMNS: dict[str, np.dtype[Any]] = {
    # (tiles, classes): share of the tile each class of meta["annotation_classes"] covers
    "coverage": np.dtype(np.float32),
    # label id (position in label_names) from the annotations, -1 when none
    "tile_label": np.dtype(np.int32),
    # quality control (index/_qc.py): qc_focus, qc_pen, qc_fold, qc_bubble, qc_background
    **QC_COLUMNS,
}


@dataclass(frozen=True)
class SlideRecord:
    """One row of the slide table. ``path`` is as stored: relative to the root when there is one."""

    path: str
    status: str = "ok"  # "ok" | "failed"
    error: str | None = None  # why a failed slide could not be indexed
    warning: str | None = None  # notes on an ok slide (repaired annotations, excluded tiles...)
    label: str | None = None  # from the manifest or labels CSV
    split: str | None = None  # train / val / test..., from the same
    patient: str | None = None  # its patient or case, from the same (slides of one: one split)
    size: int | None = None  # bytes (a DICOM series: all its files)
    mtime_ns: int | None = None  # newest modification time of its files
    fingerprint: str | None = None  # names, sizes, mtimes and head/tail bytes (identify)
    content: str | None = None  # size and head/tail digest, without name or mtime (content_key)
    backend: str | None = None  # "openslide" | "tiff": the reader that indexed it
    vendor: str | None = None  # OpenSlide's vendor name, or the TIFF flavour
    width: int | None = None  # level-0 pixels
    height: int | None = None
    level_count: int | None = None  # pyramid levels the reader sees
    mpp: float | None = None  # level-0 microns per pixel as used
    mpp_source: str | None = None  # where mpp came from (vendor, manifest, tiff-resolution...)
    objective_power: float | None = None
    read_level: int | None = None  # the level tiles are read from
    read_downsample: float | None = None  # that level's downsample from level 0
    read_size: int | None = None  # window edge read, in read-level pixels
    stride: int | None = None  # grid step in read-level pixels
    tile_mpp: float | None = None  # the resolution tiles are delivered at
    tile_mag: float | None = None  # their magnification (objective power / downsample, or 10/mpp)
    mag_source: str | None = None  # how tile_mag was found: "objective-power" or "mpp"
    aligned: bool | None = None  # grid starts on storage-tile corners
    mask_level: int | None = None  # the level the tissue mask was computed on
    tiles: int = 0
    first_row: int = 0
    excluded: int = 0  # quarantined tiles left out when this slide was indexed
    annotations: list[str] | None = None  # annotation files of the slide (absolute paths)
    annotation_digest: str | None = None  # of their contents: changed files re-index the slide
    class_areas: dict[str, float] | None = None  # annotated class -> level-0 area (px^2)
    # from the tissue of the low-resolution image (_stain_estimates.py): H and E optical-density
    # vectors, max concentrations, LAB moments; or why there is no estimate (stain_error)
    stain: dict[str, Any] | None = None
    stain_error: str | None = None
    tissue_detector: str | None = None  # brightfield | fluorescence | mask | annotation
    tissue_reason: str | None = None  # why that detector (what the picture looked like)
    tissue_mask: str | None = None  # the user's mask image (tissue_masks)
    tissue_mask_digest: str | None = None  # of its contents: a changed mask re-indexes
    qc: dict[str, Any] | None = None  # quality-control summary (index/_qc.py), excluded counts

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SlideRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


TileArrays = dict[str, npt.NDArray[Any]]


def mapped(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A plain ndarray view of a memory-mapped column: the same file mapping, without
    np.memmap's per-indexing overhead (~10 us per element lookup on the per-tile path)."""
    return array.view(np.ndarray)


class GenerationLock:
    """A shared ``flock`` on a generation's ``readers.lock``, held while this object lives.

    Builds delete an old generation only when they can take the lock exclusively. Views and
    forked children share the descriptor (flock belongs to the open file description), and a
    process that unpickles an index takes its own. Generations written before the lock file
    existed have none: nothing is held and rebuilds delete them as before.
    """

    def __init__(self, gen: Path) -> None:
        self.fd: int | None = None
        try:
            self.fd = os.open(gen / READERS_LOCK, os.O_RDONLY)
        except FileNotFoundError:
            return
        lock(self.fd, fcntl.LOCK_SH, gen / READERS_LOCK)

    # bound at class creation: an index still alive when the interpreter exits is collected
    # after module globals (``os``) are cleared
    _close = staticmethod(os.close)

    def __del__(self) -> None:
        if self.fd is not None:
            self._close(self.fd)
            self.fd = None

    # A copy shares the lock (as views do): a copied descriptor number would be closed twice,
    # the second time after the number was reused by another file (`dataclasses.asdict` and
    # Ray Data's metadata export deep-copy whatever holds an index).
    def __copy__(self) -> GenerationLock:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> GenerationLock:
        return self


def load_column(
    gen: Path, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> npt.NDArray[Any]:
    """One column file, memory-mapped, checked against the dtype and shape meta.json gives."""
    file = gen / f"{name}.npy"
    try:
        array = np.load(file, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:  # EOFError: a zero-byte file
        raise IndexFormatError(f"unreadable column {name!r}: {exc}", path=str(file)) from exc
    if array.dtype != dtype or array.shape != shape:
        raise IndexFormatError(
            f"column {name!r} has dtype {array.dtype}, shape {array.shape}; expected "
            f"{dtype} with {shape[0]} rows"
            + (f" and {shape[1]} class columns" if len(shape) > 1 else ""),
            path=str(file),
        )
    return mapped(array)


def current_generation(base: Path) -> Path:
    pointer = base / CURRENT
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise IndexFormatError("not an index directory (no CURRENT file)", path=str(base)) from None
    except NotADirectoryError:  # a slide given where an index goes (`info slide.svs`)
        raise IndexFormatError(
            "a file, not an index directory: build one with `wsi-loader index`", path=str(base)
        ) from None
    except OSError as exc:
        raise IndexFormatError(f"cannot read {CURRENT}: {exc.strerror}", path=str(base)) from exc
    except UnicodeDecodeError:
        raise IndexFormatError(
            f"{CURRENT} is not a generation name (binary data)", path=str(base)
        ) from None
    gen = base / name
    if not name.startswith("gen-") or "/" in name or not gen.is_dir():
        raise IndexFormatError(f"CURRENT names a missing generation {name!r}", path=str(base))
    return gen
