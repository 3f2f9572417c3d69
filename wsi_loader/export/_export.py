"""Freeze a tile dataset to disk for other tools: image folders, WebDataset tar shards or
CLAM's coordinates (h5).

The export is cut into deterministic units (a shard's rows, or a fixed chunk of rows for image
folders). Each unit is a plain function of small arguments (`export_unit`) that reads its tiles
through the dataset's `TileReader` (same backends, retries and quarantine), writes its files
under temporary names, renames them into place, and writes a small part record last; it returns
only that record (never pixels), so units run inline, in a process pool or on a Dask cluster.

Resuming: a unit whose record exists and whose files are intact (recorded sizes; SHA-256 with
``verify``) is complete and is skipped, so a second run with the same arguments writes only
what is missing. Records, settings and the plan are hidden plain files in the output root
(``.export-*``, see `_folder`), never folders, so image-folder readers see only class
folders. Different arguments, or an index rebuilt with other tiles, into a folder holding an
export are refused (``overwrite`` replaces it). ``manifest.csv`` (one row per exported tile,
with its split and the SHA-256 of the stored bytes), ``failures.csv`` (tiles not exported and
why: quarantined before, failed now, or without a label in image folders) and ``export.json``
(arguments, source index and counts) are written at the end, and the dataset card
(``README.md``, `_card`) that tells Hugging Face ``datasets`` the split, the classes and
the field types.

This module is the orchestration (`export_index`: options, plan, units, the tables and the
card); running the units in parallel is `_running`, a unit's work `_unit`, each format's files
are `_imagefolder`, `_webdataset` and `_coords_h5`, the tables' rows `_manifest`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from wsi_loader.config import DatasetConfig, ExportConfig, validate
from wsi_loader.dataset._context import check_context, recorded_context
from wsi_loader.dataset._cores import threads_per_process
from wsi_loader.errors import ConfigError
from wsi_loader.export._card import (
    imagefolder_card,
    warn_of_split_words,
    webdataset_card,
    write_card,
)
from wsi_loader.export._coords_h5 import export_coords
from wsi_loader.export._folder import (
    PLAN_FILE,
    SETTINGS_FILE,
    check_destination,
    clear_export,
    held,
    read_settings,
    remove_partial_files,
    unit_contents,
    unit_slides,
    unlabelled_folder,
)
from wsi_loader.export._imagefolder import label_folders, split_folders
from wsi_loader.export._manifest import FAILURE_COLUMNS, MANIFEST_COLUMNS, tile_fields, write_csv
from wsi_loader.export._running import run_units
from wsi_loader.export._unit import ExportOptions, ExportUnit
from wsi_loader.files import replacing, write_file
from wsi_loader.index._health import require_slides
from wsi_loader.index._table import SlideIndex
from wsi_loader.parallel import refuse_time_limit_with_executor
from wsi_loader.permutation import RandomPermutation
from wsi_loader.stain._build import as_stain

log = logging.getLogger(__name__)

FORMATS = ("imagefolder", "webdataset", "coords-h5")
# 2: the plan holds generation rows (splits, dropped slides); 3: image files are named without
# the slide's name, and tiles without a label are left out (or go to unlabelled_out)
EXPORT_VERSION = 3
# why a tile of the index is not in the plan (the plan's left_out rows: row, why)
QUARANTINED, UNREADABLE, UNLABELLED = 0, 1, 2


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


def _label_folders(index: SlideIndex) -> dict[str, str]:
    if index.labels_from_annotations:
        return label_folders(list(index.label_names), order=index.label_names)
    return label_folders([s.label for s in index.slides], order=index.slide_label_names)


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
    if steps is not None and options.format == "coords-h5":
        raise ConfigError(
            "stain (--stain, or a stain section in --config) cannot go with a coords-h5 "
            "export: it writes coordinates and reads no pixels",
            key="stain",
        )
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
    by_split = split_folders(index) if options.format == "imagefolder" else {}
    settings: dict[str, Any] = {
        **asdict(options),
        # a JSON value, not the string that options carry (readers accept both: read_settings)
        "stain": None if options.stain is None else json.loads(options.stain),
        "index": str(Path(index.path).resolve()),
        "split": index.split,
        "unlabelled_out": None if kept is None else str(kept),
        "version": EXPORT_VERSION,
    }
    if by_split:  # image folders of an index with splits, exported whole: DIR/<split>/<label>/
        settings["split_folders"] = by_split
    settings = json.loads(json.dumps(settings))  # as the settings file holds them (no tuples)
    # held to the end: a second export into the folder (--overwrite clears it) is refused
    with held(out_path):
        if overwrite and read_settings(out_path) is not None:
            clear_export(out_path)
        if not overwrite:
            _check_split_layout(out_path, settings)
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
        slides = unit_slides(full, order, shard_size) if contents is not None else []
        content = hashlib.sha256(
            "".join(contents or ["gone"]).encode("utf-8", "surrogateescape")
        ).hexdigest()
        if resuming and read_settings(out_path) != {**settings, "content": content}:
            raise ConfigError(
                f"{out_path} holds an export of other tiles: the index was rebuilt with "
                "different tiles since this export began; pass --overwrite (overwrite=True) to "
                "replace it, or choose an empty folder",
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
                slides=slides[i],
                verify=verify,
                threads=threads,
                quarantine=None if index.quarantine_file is None else str(index.quarantine_file),
                split_folders=tuple(by_split.items()),
            )
            for i, start in enumerate(range(0, len(order), shard_size))
        ]
        if options.format == "coords-h5":  # coordinates only: no pixels are read
            units = []
            records = [export_coords(full, order, out_path)]
        else:
            try:
                records = run_units(units, workers, executor, progress, checked.unit_timeout)
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
            fields = tile_fields(full, row)
            if left == UNREADABLE:
                reason = "slide cannot be read (missing_slides='exclude')"
            elif left == UNLABELLED:
                reason = "no label (left out of the class folders; unlabelled_out keeps them)"
            else:
                error = reasons(fields)
                reason = (
                    f"quarantined before export: {error}" if error else "quarantined before export"
                )
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
        write_csv(out_path / "manifest.csv", MANIFEST_COLUMNS, tiles)
        write_csv(out_path / "failures.csv", FAILURE_COLUMNS, failures)
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
            card = imagefolder_card(options.image_ext, classes, index.split, list(by_split.items()))
            write_card(out_path, card)
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


def _check_split_layout(out: Path, settings: dict[str, Any]) -> None:
    """Refuse to resume an export whose layout by split (``split_folders``: an index with
    splits exported whole is laid out DIR/<split>/<label>/) is not the index's now, naming
    that setting and what to do; the other settings are compared by `check_destination`."""
    previous = read_settings(out)
    if previous is None or previous.get("version") != settings["version"]:
        return
    theirs, mine = previous.get("split_folders") or {}, settings.get("split_folders") or {}
    if theirs == mine:
        return

    def layout(folders: dict[str, str]) -> str:
        if not folders:
            return "flat (DIR/<label>/)"
        names = ", ".join(name or "no split" for name in sorted(folders))
        return f"by split (DIR/<split>/<label>/, splits {names})"

    raise ConfigError(
        f"{out} holds an export laid out {layout(theirs)}, and the index's splits now lay it "
        f"out {layout(mine)} (setting split_folders: the index's splits changed since, e.g. "
        "by wsi-loader split or a rebuild), so it cannot be resumed: pass --overwrite "
        "(overwrite=True) to export it again laid out by the index's splits, export one "
        "split (--split NAME) or the whole index into an empty folder",
        path=str(out),
        key="split_folders",
    )


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
