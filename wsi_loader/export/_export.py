"""Freeze a tile dataset to disk for other tools: image folders or WebDataset tar shards.

The export is cut into deterministic units (a shard's rows, or a fixed chunk of rows for image
folders). Each unit is a plain function of small arguments (`export_unit`) that reads its tiles
through the dataset's `TileReader` (same backends, retries and quarantine), writes its files
under temporary names, renames them into place, and writes a small part record last; it returns
only that record (never pixels), so units run inline, in a process pool or on a Dask cluster.

Resuming: a unit whose record exists and whose files are intact (recorded sizes; SHA-256 with
``verify``) is complete and is skipped, so a second run with the same arguments writes only
what is missing. Records, settings and the plan are hidden plain files in the output root
(``.export-*``, see `export_folder`), never folders, so image-folder readers see only class
folders. Different arguments, or an index rebuilt with other tiles, into a folder holding an
export are refused (``overwrite`` replaces it). ``manifest.csv`` (one row per exported tile,
with its split and the SHA-256 of the stored bytes), ``failures.csv`` (tiles not exported and
why: quarantined before, failed now, or without a label in image folders) and ``export.json``
(arguments, source index and counts) are written at the end, and the dataset card
(``README.md``, `dataset_card`) that tells Hugging Face ``datasets`` the split, the classes and
the field types.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import tarfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from wsi_loader.config import DatasetConfig, ExportConfig, validate
from wsi_loader.dataset._context import check_context, recorded_context
from wsi_loader.dataset._cores import threads_per_process
from wsi_loader.dataset._reading import TileReader
from wsi_loader.errors import (
    ConfigError,
    OutputError,
    TransientReadError,
    UnitsNotDoneError,
    UnitTimeoutError,
    WorkerDiedError,
)
from wsi_loader.export._card import (
    imagefolder_card,
    warn_of_split_words,
    webdataset_card,
    write_card,
)
from wsi_loader.export._folder import (
    PARTS_FILE,
    PLAN_FILE,
    SETTINGS_FILE,
    check_destination,
    clear_export,
    outputs_intact,
    part_records,
    read_settings,
    relative_name,
    remove_partial_files,
    unit_contents,
    unlabelled_folder,
)
from wsi_loader.files import append_line, locked, replacing, write_file
from wsi_loader.index._health import require_slides
from wsi_loader.index._naming import file_text, h5_file_names, key_component, safe_component
from wsi_loader.index._table import SlideIndex, label_order
from wsi_loader.parallel import (
    GivenUp,
    progress_bar,
    refuse_time_limit_with_executor,
    run_all,
)
from wsi_loader.permutation import RandomPermutation
from wsi_loader.stain._transforms import as_stain, from_spec

log = logging.getLogger(__name__)

FORMATS = ("imagefolder", "webdataset", "coords-h5")
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
# 2: the plan holds generation rows (splits, dropped slides); 3: image files are named without
# the slide's name, and tiles without a label are left out (or go to unlabelled_out)
EXPORT_VERSION = 3
MANIFEST_COLUMNS = (
    "file",
    "member",
    "row",
    "slide_id",
    "slide_path",
    "x",
    "y",
    "level",
    "read_size",
    "tile_mpp",
    "label",
    "slide_label",
    "split",
    "sha256",
)
FAILURE_COLUMNS = ("row", "slide_id", "slide_path", "x", "y", "level", "reason")
# why a tile of the index is not in the plan (the plan's left_out rows: row, why)
QUARANTINED, UNREADABLE, UNLABELLED = 0, 1, 2


def label_folders(
    labels: Sequence[str | None], order: Sequence[str] | None = None
) -> dict[str, str]:
    """Folder per label (None, no label, has none); labels that sanitise to the same name get
    a short hash suffix. ``order`` is the labels' id order (the index's label names;
    `label_order` by default). When the folders' sorted order (which torchvision's
    ImageFolder and Hugging Face's ClassLabel turn into class ids) differs from it (sanitised
    names, numbers: '10' < '2' as text), every folder gets its rank as a prefix, so the ids
    stay the index's."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    present = {lb for lb in labels if lb is not None}
    ranked = [lb for lb in order or () if lb in present]
    ranked += label_order(present - set(ranked))
    for label in ranked:
        folder = safe_component(label)
        if folder in taken:
            folder = f"{folder}-{hashlib.sha256(label.encode()).hexdigest()[:8]}"
        out[label] = folder
        taken.add(folder)
    if sorted(ranked, key=lambda lb: out[lb]) != ranked:
        width = len(str(len(ranked)))
        out.update({lb: f"{k:0{width}d}-{out[lb]}" for k, lb in enumerate(ranked)})
    return out


@dataclass(frozen=True)
class ExportOptions:
    format: str = "imagefolder"
    image_format: str = "png"
    quality: int = 90
    shard_size: int = 1000  # tiles per tar shard, and per unit of work for image folders
    shuffle: bool = False  # the export order is a seeded permutation (shards mix slides)
    seed: int = 0
    # not options of export_index: a substituted tile would be exported under the wrong
    # coordinates, and reads that still fail are listed in failures.csv, never exported
    on_error: str = "fill"
    retries: int = 2
    # context tiles (webdataset): (mpp, size) per scale, written as KEY.ctx1.<ext>...
    context: tuple[tuple[float, int], ...] = ()
    stain: str | None = None  # JSON of the stain transforms' spec (`wsi_loader.stain`)

    @property
    def image_ext(self) -> str:
        """The file extension of the exported images (a WebDataset sample's field name)."""
        return "jpg" if self.image_format == "jpeg" else self.image_format


@dataclass(frozen=True)
class ExportUnit:
    """Rows of the export order (rows of ``generation``, which the unit reads even when the
    index was rebuilt meanwhile), read from the index at ``index_path``."""

    number: int
    rows: tuple[int, ...]
    index_path: str
    generation: str
    root: str | None
    out: str
    options: ExportOptions
    folders: tuple[tuple[str, str], ...]
    unlabelled_out: str | None = None  # image folders: where tiles without a label go
    content: str = ""  # digest of what the unit holds (rows' slide, x, y, level, size, label)
    verify: bool = False  # a finished unit counts only when its files hash as recorded
    rewrite: bool = False  # it has a record whose files are gone or changed: write them all
    threads: int = 1  # reading and encoding threads (PNG/WebP encoders release the GIL)
    quarantine: str | None = None  # failed reads go here (None: the index's own)


@dataclass
class ExportReport:
    out: Path
    tiles: int
    failed: int
    quarantined: int
    units: int
    units_skipped: int
    shards: list[dict[str, Any]]
    unlabelled: int = 0  # tiles without a label left out of the image folders


def _encode(pixels: np.ndarray, options: ExportOptions) -> bytes:
    buf = io.BytesIO()
    kind = IMAGE_FORMATS[options.image_format]
    if kind == "PNG":
        Image.fromarray(pixels).save(buf, kind, compress_level=3)
    else:
        Image.fromarray(pixels).save(buf, kind, quality=options.quality)
    return buf.getvalue()


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # deterministic bytes
    tar.addfile(info, io.BytesIO(data))


def _append_part(out: Path, record: dict[str, Any]) -> None:
    """Append a finished unit's record (after its files are in place) under an exclusive
    lock, starting on a fresh line if a killed writer left a torn one."""
    path = out / PARTS_FILE
    try:
        with locked(path):
            append_line(path, record)
    except OSError as exc:  # the unit's files are in place; it is redone on the next run
        raise OutputError(exc.strerror or str(exc), path=str(path), code=exc.errno) from exc


def _completed(unit: ExportUnit, records: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The record (of ``records``, the parts file) of a unit a previous run completed whose
    outputs are still intact (marked skipped), else None: a deleted or truncated shard or
    image makes the unit run again."""
    out = Path(unit.out)
    record = records.get(unit.number)
    if record is None or record.get("content") != unit.content:
        return None
    if not outputs_intact(out, record, unit.verify):
        log.warning("export unit %d: outputs missing or changed, writing it again", unit.number)
        return None
    return {**record, "skipped": True}


def tile_label(index: SlideIndex, row: int) -> str | None:
    """The label of a tile by name: its annotated class (an index built with
    ``label_from="annotations"``), else its slide's label; None when it has none."""
    if not index.labels_from_annotations:
        return index.slides[int(index.columns["slide_id"][row])].label
    label_id = int(index.columns["tile_label"][row])
    return index.label_names[label_id] if label_id >= 0 else None


def _label_folders(index: SlideIndex) -> dict[str, str]:
    if index.labels_from_annotations:
        return label_folders(list(index.label_names), order=index.label_names)
    return label_folders([s.label for s in index.slides], order=index.slide_label_names)


def _tile_fields(index: SlideIndex, row: int) -> dict[str, Any]:
    """Where a tile comes from: the columns manifest.csv and failures.csv share."""
    cols = index.columns
    sid = int(cols["slide_id"][row])
    return {
        "row": row,
        "slide_id": sid,
        "slide_path": index.slides[sid].path,
        "x": int(cols["l0_x"][row]),
        "y": int(cols["l0_y"][row]),
        "level": int(cols["level"][row]),
    }


def export_unit(unit: ExportUnit) -> dict[str, Any]:
    """Export one unit (the runner skips complete ones); returns its part record (manifest
    and failure rows)."""
    # a unit whose record exists but whose files were deleted or truncated is written anew;
    # without a record, image files under their final names are complete (atomic renames)
    reuse_files = not unit.rewrite
    out = Path(unit.out)
    index = SlideIndex.open(
        unit.index_path, root=unit.root, generation=unit.generation, quarantine=unit.quarantine
    )
    reader = TileReader(
        index,
        on_error=unit.options.on_error,
        retries=unit.options.retries,
        context=unit.options.context,
    )
    rows = np.asarray(unit.rows, dtype=np.int64)
    cols, folders = index.columns, dict(unit.folders)
    ext = unit.options.image_ext

    def key_of(row: int) -> str:
        sid = int(cols["slide_id"][row])
        stem = key_component(Path(index.slides[sid].path).stem)
        return f"s{sid:05d}_{stem}_x{int(cols['l0_x'][row])}_y{int(cols['l0_y'][row])}"

    def file_of(row: int) -> Path:
        # no slide name in it: Hugging Face's imagefolder reads "train", "val", "test"...
        # between separators in a file name as a split (Camelyon16's test_001), and a name
        # of letters s, x, y, digits and '_' holds no word
        sid = int(cols["slide_id"][row])
        name = f"s{sid:05d}_x{int(cols['l0_x'][row])}_y{int(cols['l0_y'][row])}.{ext}"
        label = tile_label(index, row)
        if label is None:  # the plan holds such tiles only with unlabelled_out
            assert unit.unlabelled_out is not None
            return Path(unit.unlabelled_out) / name
        return out / folders[label] / name

    imagefolder = unit.options.format == "imagefolder"
    files = [file_of(r) if imagefolder else None for r in rows.tolist()]
    # image files already under their final name are complete (atomic renames): keep them
    done = np.array([reuse_files and f is not None and f.exists() for f in files], dtype=bool)
    result = reader.read(rows[~done], threads=unit.threads)
    if unit.options.stain is not None:
        steps = from_spec(json.loads(unit.options.stain))
        if steps is not None:
            read = rows[~done]
            slide_ids = np.asarray(cols["slide_id"][read], dtype=np.int64)
            # (export_index warned of the slides without an estimate, once)
            bound = steps.bind(index, warn=False)
            for scale in (result.pixels, *result.context):  # context tiles as their tile
                bound.apply_numpy(scale, slide_ids, read, 0, result.ok)
    encoded = _encode_all(result.pixels, result.ok, unit.options, unit.threads)
    context_encoded = [
        _encode_all(tiles, result.ok, unit.options, unit.threads) for tiles in result.context
    ]
    pixels = iter(range(len(result.ok)))
    tiles, failures, members = [], [], []
    outputs: list[tuple[str, int, str]] = []  # (name under out, size, sha256) of every file
    for i, row in enumerate(rows.tolist()):
        base = _tile_fields(index, row)
        slide = index.slides[base["slide_id"]]
        path = files[i]
        context_data: list[bytes] = []  # the encoded context tiles (webdataset)
        context_meta: list[dict[str, Any]] = []
        if path is not None and done[i]:
            data = path.read_bytes()
        else:
            j = next(pixels)
            if not result.ok[j]:
                failures.append({**base, "reason": f"read failed: {result.errors[j]}"})
                continue
            data = encoded[j]
            if context_encoded:
                context_data = [scale[j] for scale in context_encoded]
                context_meta = _context_meta(reader, row, j, result)
        entry = {
            **base,
            "read_size": int(cols["read_size"][row]),
            "tile_mpp": slide.tile_mpp,
            "label": tile_label(index, row),
            "slide_label": slide.label,
            "split": slide.split,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        if path is not None:
            if not done[i]:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_file(path, data)
            name = relative_name(path, out)
            outputs.append((name, len(data), entry["sha256"]))
            tiles.append({**entry, "file": name, "member": ""})
        else:
            key = key_of(row)
            meta = {
                "slide": slide.path,
                "slide_id": base["slide_id"],
                "x": base["x"],
                "y": base["y"],
                "level": base["level"],
                "read_size": entry["read_size"],
                "mpp": slide.tile_mpp,
                "label": entry["label"],
                "label_id": int(index.tile_labels([row])[0]),
                "slide_label": slide.label,
                "split": slide.split,
                "row": row,
            }
            if index.coverage is not None:
                meta["coverage"] = {
                    name: round(float(value), 6)
                    for name, value in zip(index.classes, index.coverage[row], strict=True)
                }
            if context_meta:
                meta["context"] = context_meta
            members.append(
                (key, ext, data, json.dumps(meta, sort_keys=True).encode(), context_data)
            )
            tiles.append(
                {**entry, "file": f"shard-{unit.number:06d}.tar", "member": f"{key}.{ext}"}
            )
    transient = [e for e in result.errors if e is not None and e.startswith("resource error")]
    if transient:  # not the data's fault: leave the unit incomplete, so a rerun retries it
        reader.close()
        raise TransientReadError(
            f"{len(transient)} tiles of export unit {unit.number} could not be read for want "
            f"of resources ({transient[0]}); run the same export again to finish it"
        )
    shard = None
    if unit.options.format == "webdataset":
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, image_ext, data, meta_bytes, context_data in members:
                _tar_member(tar, f"{key}.{image_ext}", data)
                for k, tile in enumerate(context_data, start=1):
                    _tar_member(tar, f"{key}.ctx{k}.{image_ext}", tile)
                _tar_member(tar, f"{key}.json", meta_bytes)
        name = f"shard-{unit.number:06d}.tar"
        data = buf.getvalue()
        shard = {
            "file": name,
            "tiles": len(members),
            "bytes": len(data),
            "slides": len({t["slide_id"] for t in tiles}),
        }
        write_file(out / name, data)
        outputs.append((name, len(data), hashlib.sha256(data).hexdigest()))
    reader.close()
    record = {
        "unit": unit.number,
        "content": unit.content,
        "tiles": tiles,
        "failures": failures,
        "shard": shard,
        "outputs": outputs,
    }
    _append_part(out, record)  # last: marks it complete
    return record


def _context_meta(reader: TileReader, row: int, j: int, result: Any) -> list[dict[str, Any]]:
    """The ``context`` entries of a sample's JSON: per scale, its MPP and size, the window
    read (level-0 top-left, level, edge in level pixels) and the box on the slide."""
    entries = []
    for k, ((_, x, y, level, read), _) in enumerate(reader.context_windows(row)):
        mpp, size = reader.context[k]
        entries.append(
            {
                "mpp": mpp,
                "size": size,
                "x": x,
                "y": y,
                "level": level,
                "read_size": read,
                "inside": [int(v) for v in result.context_inside[j, k]],
            }
        )
    return entries


def _encode_all(
    pixels: np.ndarray, ok: np.ndarray, options: ExportOptions, threads: int
) -> dict[int, bytes]:
    """Encoded bytes of every tile read without failure, by position."""
    todo = np.flatnonzero(ok).tolist()
    if threads < 2 or len(todo) < 2:
        return {j: _encode(pixels[j], options) for j in todo}
    with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="wsi-encode") as pool:
        return dict(zip(todo, pool.map(lambda j: _encode(pixels[j], options), todo), strict=True))


def export_index(
    index: SlideIndex | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    format: str = "imagefolder",
    image_format: str = "png",
    quality: int = 90,
    shard_size: int = 1000,
    workers: int = 1,
    executor: Any = None,
    progress: bool = False,
    root: str | None = None,
    split: str | None = None,
    missing_slides: str = "raise",
    unit_timeout: float = 0,
    verify: bool = False,
    overwrite: bool = False,
    shuffle: bool = False,
    seed: int = 0,
    quarantine: str | os.PathLike[str] | None = None,
    unlabelled_out: str | os.PathLike[str] | None = None,
    context: Sequence[tuple[float, int]] | None = None,
    stain: Any = None,
) -> ExportReport:
    """Export every tile of an index, or of one ``split`` (quarantined tiles are left out
    and listed with their reason). ``stain``: transforms of `wsi_loader.stain` applied to
    every tile before it is encoded (``Normalize("macenko", target=...)``); the resolved
    target is recorded in the settings (``export.json``), so a resumed export keeps it.

    Image folders hold labelled tiles only: a folder of tiles without a label would be one
    more class to every reader (torchvision's ImageFolder, Hugging Face's ClassLabel), so
    they are left out, counted (``ExportReport.unlabelled``, a WARNING) and listed in
    failures.csv, unless ``unlabelled_out`` names a folder outside ``out`` to hold them.

    Slides that cannot be read are found first: ``missing_slides="raise"`` (default) stops
    with `SlideNotFoundError` before anything is written, ``"exclude"`` leaves them out (their
    tiles are listed in failures.csv). The export reads the index generation it started with
    to the end. ``executor``: None (local processes when ``workers > 1``), any
    concurrent.futures Executor, or a ``dask.distributed.Client`` (workers must see ``out`` and
    the slides).

    ``shuffle`` (with ``seed``): the export order is a seeded permutation, so every shard
    mixes tiles from many slides (a WebDataset shuffle buffer alone leaves batches from one or
    two slides when shards follow the index order); ``export.json`` reports slides per shard.
    ``quarantine``: the file failed reads go to and quarantined tiles come from, instead of
    the index's own (an index on a read-only mount; see `SlideIndex.open`).

    ``context=[(mpp, size), ...]`` (WebDataset only; default: the index's ``index --context``
    for WebDataset exports): every sample also gets its co-centred context tiles as
    ``KEY.ctx1.<ext>``, ``KEY.ctx2.<ext>``... and a ``context`` list in its JSON (scale,
    window read, part on the slide); a tile whose context cannot be read is not exported.

    A unit whose worker process dies under it (the out-of-memory killer) or, with
    ``unit_timeout`` (seconds; 0: no limit), is not done in time (reads that hang on a
    mount that stopped answering) is given up: the other units finish, then the export ends
    with `WorkerDiedError` or `UnitTimeoutError` (both `UnitsNotDoneError`) naming those
    units; the same export again does only them. A time limit needs local workers.

    Resuming: a unit counts as done when its files exist with their recorded sizes (and, with
    ``verify``, SHA-256); deleted or truncated ones are written again. The export is known by
    what it holds (each tile's slide, x, y, level, size, label, and the settings), not by the
    index generation: a rebuild with the same tiles resumes; one whose tiles changed is
    refused unless ``overwrite``, which replaces the export's files.
    """
    checked: ExportConfig = validate(
        ExportConfig,
        {
            "format": format,
            "image_format": image_format,
            "quality": quality,
            "shard_size": shard_size,
            "workers": workers,
            "unit_timeout": unit_timeout,
            "shuffle": shuffle,
            "seed": seed,
        },
    )
    refuse_time_limit_with_executor("unit_timeout", checked.unit_timeout, executor)
    out_path = Path(out)
    kept = unlabelled_folder(unlabelled_out, out_path, checked.format)
    options = ExportOptions(
        format=checked.format,
        image_format=checked.image_format,
        quality=checked.quality,
        shard_size=checked.shard_size,
        shuffle=checked.shuffle,
        seed=checked.seed,
    )
    if not isinstance(index, SlideIndex):
        index = SlideIndex.open(index, root=root)
    elif root is not None:
        index = index.view(root=root)
    index = index.view(split=split, quarantine=quarantine)
    scales = _context_scales(index, context, options.format)
    options = replace(options, context=tuple(scales))
    steps = as_stain(stain)
    if steps is not None:  # targets resolved now (an archive median, a file), once
        options = replace(options, stain=json.dumps(steps.bind(index).spec(), sort_keys=True))
    readable = require_slides(index, missing_slides)
    if options.format == "imagefolder" and kept is None and not (index.tile_labels() >= 0).any():
        raise ConfigError(
            f"none of the {len(index)} tiles of {index.path} has a label, and image folders "
            "hold labelled tiles, a folder per label: pass --unlabelled-out DIR "
            "(unlabelled_out=DIR) to write them to a plain folder, or use --format webdataset",
            key="unlabelled_out",
        )
    settings: dict[str, Any] = {
        **asdict(options),
        # a JSON value, not the string that options carry (readers accept both: read_settings)
        "stain": None if options.stain is None else json.loads(options.stain),
        "index": str(Path(index.path).resolve()),
        "split": index.split,
        "unlabelled_out": None if kept is None else str(kept),
        "version": EXPORT_VERSION,
    }
    settings = json.loads(json.dumps(settings))  # as the settings file holds them (no tuples)
    if overwrite and read_settings(out_path) is not None:
        clear_export(out_path)
    resuming = check_destination(out_path, settings)
    remove_partial_files(out_path, kept)
    out_path.mkdir(parents=True, exist_ok=True)
    generation = str(index.meta["generation"])
    full = SlideIndex.open(
        index.path, root=index.root, generation=generation, quarantine=index.quarantine_file
    )

    # The plan (which generation rows, in which order; which were left out) is fixed by the
    # first run, so units keep their contents when a resumed run sees a quarantine that grew.
    plan = out_path / PLAN_FILE
    if resuming and plan.exists():
        with np.load(plan) as saved:
            order, left_out = saved["order"], saved["left_out"]
    else:
        rows = _generation_rows(index)
        why = np.full(len(rows), -1, dtype=np.int64)  # -1: exported
        why[index.quarantined_mask()] = QUARANTINED
        why[~np.isin(rows, _generation_rows(readable))] = UNREADABLE
        if options.format == "imagefolder" and kept is None:
            why[index.tile_labels() < 0] = UNLABELLED
        order = rows[why < 0]
        if options.shuffle:  # a keyed permutation, as DistributedTileSampler's
            order = order[RandomPermutation(len(order), options.seed)(np.arange(len(order)))]
        left_out = np.stack([rows[why >= 0], why[why >= 0]], axis=1)
        # (the temporary name ends in .npz: np.savez would add it)
        with replacing(plan, plan.with_name(f".plan.tmp-{os.getpid()}.npz")) as tmp:
            np.savez(tmp, order=order, left_out=left_out)
    contents = unit_contents(full, order, shard_size)
    content = hashlib.sha256(
        "".join(contents or ["gone"]).encode("utf-8", "surrogateescape")
    ).hexdigest()
    if resuming and read_settings(out_path) != {**settings, "content": content}:
        raise ConfigError(
            f"{out_path} holds an export of other tiles: the index was rebuilt with different "
            "tiles since this export began; pass --overwrite (overwrite=True) to replace it, or "
            "choose an empty folder",
            path=str(out_path),
        )
    assert contents is not None  # a fresh plan always fits its own generation
    write_file(
        out_path / SETTINGS_FILE,
        json.dumps({**settings, "content": content}, sort_keys=True).encode(),
    )
    folders = tuple(_label_folders(index).items())
    if options.format == "imagefolder":
        warn_of_split_words(dict(folders).values(), out_path)
    # local processes share this machine's cores; an executor's workers are sized by their owner
    threads = threads_per_process(workers) if executor is None else 1
    units = [
        ExportUnit(
            number=i,
            rows=tuple(order[start : start + shard_size].tolist()),
            index_path=str(index.path),
            generation=generation,
            root=index.root,
            out=str(out_path),
            options=options,
            folders=folders,
            unlabelled_out=None if kept is None else str(kept),
            content=contents[i],
            verify=verify,
            threads=threads,
            quarantine=None if index.quarantine_file is None else str(index.quarantine_file),
        )
        for i, start in enumerate(range(0, len(order), shard_size))
    ]
    if options.format == "coords-h5":  # coordinates only: no pixels are read
        units = []
        records = [_export_coords(full, order, out_path)]
    else:
        try:
            records = _run(units, workers, executor, progress, checked.unit_timeout)
        except BaseException:
            # local workers are ended by now; one ended mid-write (the others' unit failed on
            # a full disk) left its temporary file, which would keep the space it took
            if executor is None:
                remove_partial_files(out_path, kept)
            raise
    tiles = [t for r in records for t in r["tiles"]]
    failures = [f for r in records for f in r["failures"]]
    reasons = _quarantine_reasons(full)
    for row, left in left_out.tolist():
        fields = _tile_fields(full, row)
        if left == UNREADABLE:
            reason = "slide cannot be read (missing_slides='exclude')"
        elif left == UNLABELLED:
            reason = "no label (left out of the class folders; unlabelled_out keeps them)"
        else:
            error = reasons(fields)
            reason = f"quarantined before export: {error}" if error else "quarantined before export"
        failures.append({**fields, "reason": reason})
    failures.sort(key=lambda f: f["row"])
    quarantined = int((left_out[:, 1] == QUARANTINED).sum())
    unlabelled = int((left_out[:, 1] == UNLABELLED).sum())
    if unlabelled:
        log.warning(
            "%d tiles have no label: they are left out of the image folders (a folder of "
            "them would be one more class to every reader) and listed in failures.csv; "
            "--unlabelled-out DIR (unlabelled_out=DIR) writes them to a folder outside the "
            "export",
            unlabelled,
        )
    _write_csv(out_path / "manifest.csv", MANIFEST_COLUMNS, tiles)
    _write_csv(out_path / "failures.csv", FAILURE_COLUMNS, failures)
    shards = [r["shard"] for r in records if r.get("shard")]
    report = ExportReport(
        out=out_path,
        tiles=len(tiles),
        failed=len(failures) - quarantined - unlabelled,
        quarantined=quarantined,
        units=len(units),
        units_skipped=sum(bool(r.get("skipped")) for r in records),
        shards=shards,
        unlabelled=unlabelled,
    )
    per_shard = [sh["slides"] for sh in shards]
    summary = {
        "settings": {**settings, "content": content},
        "generation": generation,
        "slides_per_shard": {
            "mean": float(np.mean(per_shard)) if per_shard else 0.0,
            "min": min(per_shard, default=0),
            "max": max(per_shard, default=0),
        },
        "tiles": report.tiles,
        "failed": report.failed,
        "quarantined": report.quarantined,
        "unlabelled": report.unlabelled,
        "shards": shards,
        "label_folders": {str(k): v for k, v in folders},
    }
    write_file(out_path / "export.json", json.dumps(summary, indent=1, sort_keys=True).encode())
    if options.format == "webdataset":
        classes = list(index.classes) if index.coverage is not None else []
        card = webdataset_card(options.image_ext, classes, index.split, len(options.context))
        write_card(out_path, card)
    elif options.format == "imagefolder":
        # every label of the index, present or not: the class ids are then the index's
        # label ids (the folders sort in that order) in an export of any split
        classes = sorted(folder for _, folder in folders)
        write_card(out_path, imagefolder_card(options.image_ext, classes, index.split))
    return report


def _context_scales(
    index: SlideIndex, given: Sequence[tuple[float, int]] | None, format: str
) -> list[tuple[float, int]]:
    """The context scales an export writes: the given ones (WebDataset only), else the index's
    default for a WebDataset export; checked against the slides like a dataset's."""
    scales: list[tuple[float, int]] = (
        validate(DatasetConfig, {"context": list(given)}).context or [] if given is not None else []
    )
    if scales and format != "webdataset":
        raise ConfigError(
            f"context tiles are written into WebDataset samples (KEY.ctx1.jpg...); a {format} "
            "export has no place for them: use --format webdataset, or no --context",
            key="context",
            value=scales,
        )
    if given is None and format == "webdataset":
        scales = recorded_context(index)
    check_context(index, scales)
    return scales


def _export_coords(full: SlideIndex, order: np.ndarray, out: Path) -> dict[str, Any]:
    """One HDF5 file per slide with a ``coords`` dataset (N x 2 level-0 x, y, int64) whose
    attributes ``patch_size`` (the window at ``patch_level``) and ``patch_level`` are what
    CLAM's and TRIDENT's feature extractors read, plus ``tile_size``, ``tile_mpp``,
    ``downsample`` and ``name``. Written under a temporary name and renamed."""
    try:
        import h5py
    except ImportError as exc:
        raise ConfigError(
            "--format coords-h5 needs h5py: pip install 'wsi_loader[h5]'", key="format"
        ) from exc
    cols = full.columns
    slide_of = np.asarray(cols["slide_id"][order], dtype=np.int64)
    slide_ids = sorted(set(slide_of.tolist()))
    names = h5_file_names(full, slide_ids)
    tiles, outputs = [], []
    for sid in slide_ids:
        rows = order[slide_of == sid]
        record = full.slides[sid]
        coords = np.stack(
            [np.asarray(cols["l0_x"][rows], np.int64), np.asarray(cols["l0_y"][rows], np.int64)],
            axis=1,
        )
        path = out / names[sid]
        buf = io.BytesIO()  # (see files.write_file)
        with h5py.File(buf, "w") as h5:
            dataset = h5.create_dataset("coords", data=coords)
            attrs = {
                "patch_size": int(cols["read_size"][rows[0]]),
                "patch_level": int(cols["level"][rows[0]]),
                "tile_size": int(full.params["tile_size"]),
                "downsample": float(record.read_downsample or 1.0),
                "name": file_text(Path(names[sid]).stem),
                "slide": file_text(record.path),
            }
            if record.tile_mpp is not None:
                attrs["tile_mpp"] = float(record.tile_mpp)
            for target in (dataset, h5):
                target.attrs.update(attrs)
        write_file(path, buf.getvalue())
        data = path.read_bytes()
        outputs.append((path.name, len(data), hashlib.sha256(data).hexdigest()))
        for member, row in enumerate(rows.tolist()):
            tiles.append(
                {
                    **_tile_fields(full, row),
                    "read_size": int(cols["read_size"][row]),
                    "tile_mpp": record.tile_mpp,
                    "label": tile_label(full, row),
                    "slide_label": record.label,
                    "split": record.split,
                    "sha256": "",
                    "file": path.name,
                    "member": f"coords[{member}]",
                }
            )
    return {"unit": 0, "tiles": tiles, "failures": [], "shard": None, "outputs": outputs}


def _generation_rows(index: SlideIndex) -> np.ndarray:
    """The generation row of every row of ``index`` (a view maps them; else the identity)."""
    if index.source_rows is not None:
        return index.source_rows
    return np.arange(len(index), dtype=np.int64)


def _quarantine_reasons(index: SlideIndex) -> Callable[[dict[str, Any]], str]:
    """The recorded error of a quarantined tile (`_tile_fields`): its record at its level, else
    one naming no level; records of another version of the slide left out, as the mask does."""
    reasons = index.quarantine.reasons(
        {s.path: s.fingerprint for s in index.slides if s.fingerprint}
    )

    def reason(fields: dict[str, Any]) -> str:
        at = (fields["slide_path"], fields["x"], fields["y"])
        return reasons.get((*at, fields["level"])) or reasons.get((*at, None)) or ""

    return reason


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    # a path that is not UTF-8 (see `file_text`) is written as the file system's own bytes
    write_file(path, buf.getvalue().encode("utf-8", "surrogateescape"))


def _unit_size(unit: ExportUnit) -> int:
    return len(unit.rows)


def _run(
    units: list[ExportUnit], workers: int, executor: Any, progress: bool, timeout: float
) -> list[dict[str, Any]]:
    total = sum(len(u.rows) for u in units)
    with progress_bar(total, "tile", "exporting", progress and bool(units)) as bar:
        results: dict[int, dict[str, Any]] = {}
        parts = part_records(Path(units[0].out)) if units else {}
        for unit in units:  # completed units are read back here, without starting any worker
            previous = _completed(unit, parts)
            if previous is not None:
                results[unit.number] = previous
                bar.update(len(unit.rows))
        # the parts file is read here once; units never read it (it holds every manifest row)
        todo = [replace(u, rewrite=u.number in parts) for u in units if u.number not in results]
        done = run_all(
            export_unit,
            todo,
            workers,
            executor,
            bar,
            _unit_size,
            given_up=_given_up,
            timeout=timeout or None,
        )
        for unit, record in zip(todo, done, strict=True):
            results[unit.number] = record
    given_up = {r["unit"]: r["given_up"] for r in results.values() if "given_up" in r}
    if given_up:
        raise _not_done(given_up)
    return [results[number] for number in sorted(results)]


def _given_up(unit: ExportUnit, why: GivenUp) -> dict[str, Any]:
    """The record of a unit its worker did not finish (nothing of it is kept)."""
    if why.kind == "timeout":
        reason = f"was not done after {why.detail} s (unit_timeout), so its worker was ended"
    else:
        reason = f"had its worker process die under it ({why.detail})"
    return {"unit": unit.number, "given_up": reason, "kind": why.kind}


def _not_done(reasons: dict[int, str]) -> UnitsNotDoneError:
    """The error that ends an export some units of which were given up."""
    units = sorted(reasons)
    said = "; ".join(f"export unit {u} {reasons[u]}" for u in units[:5])
    more = f" (and {len(units) - 5} more units)" if len(units) > 5 else ""
    timeouts = [u for u in units if "unit_timeout" in reasons[u]]
    hint = (
        "with fewer workers if memory is short"
        if not timeouts
        else "after checking the slides' storage answers, or with a larger --unit-timeout if "
        "a unit is merely slow"
    )
    kind: type[UnitsNotDoneError] = UnitsNotDoneError  # some of each
    if not timeouts:
        kind = WorkerDiedError
    elif len(timeouts) == len(units):
        kind = UnitTimeoutError
    return kind(
        f"{said}{more}; the other units are finished: run the same export again to finish it "
        f"({hint})",
        units=units,
        reasons=reasons,
    )
