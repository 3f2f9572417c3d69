"""One unit of an export: read its tiles through the dataset's `TileReader`, encode them, write
its files (image files, or a shard) under temporary names and rename them into place, then
append its part record, which marks it complete; `ExportOptions` and `ExportUnit` are what a
unit is given (small, picklable: units run inline, in a process pool or on a Dask cluster).
"""

from __future__ import annotations

import hashlib
import io
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from wsi_loader.dataset._reading import TileReader
from wsi_loader.errors import OutputError, TransientReadError
from wsi_loader.export._folder import PARTS_FILE, relative_name
from wsi_loader.export._imagefolder import image_file
from wsi_loader.export._manifest import tile_fields, tile_label
from wsi_loader.export._webdataset import context_meta, sample_key, sample_meta, write_shard
from wsi_loader.files import append_line, locked, write_file
from wsi_loader.index._table import SlideIndex
from wsi_loader.stain._build import from_spec

IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


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
    slides: str = ""  # digest of its slides' contents (`_folder.unit_slides`)
    verify: bool = False  # a finished unit counts only when its files hash as recorded
    rewrite: bool = False  # it has a record whose files are gone or changed: write them all
    threads: int = 1  # reading and encoding threads (PNG/WebP encoders release the GIL)
    quarantine: str | None = None  # failed reads go here (None: the index's own)
    # image folders of an index with splits exported whole: split name ("" for none) ->
    # folder, DIR/<split>/<label>/ (empty: DIR/<label>/)
    split_folders: tuple[tuple[str, str], ...] = ()


def _encode(pixels: np.ndarray, options: ExportOptions) -> bytes:
    buf = io.BytesIO()
    kind = IMAGE_FORMATS[options.image_format]
    if kind == "PNG":
        Image.fromarray(pixels).save(buf, kind, compress_level=3)
    else:
        Image.fromarray(pixels).save(buf, kind, quality=options.quality)
    return buf.getvalue()


def _append_part(out: Path, record: dict[str, Any]) -> None:
    """Append a finished unit's record (after its files are in place) under an exclusive
    lock, starting on a fresh line if a killed writer left a torn one."""
    path = out / PARTS_FILE
    try:
        with locked(path):
            append_line(path, record)
    except OSError as exc:  # the unit's files are in place; it is redone on the next run
        raise OutputError(exc.strerror or str(exc), path=str(path), code=exc.errno) from exc


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
    splits = dict(unit.split_folders) or None

    imagefolder = unit.options.format == "imagefolder"
    files = [
        image_file(index, r, out, folders, unit.unlabelled_out, ext, splits)
        if imagefolder
        else None
        for r in rows.tolist()
    ]
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
    # once per unit: a tile's label id looks up its slide's among every slide's labels
    label_ids = index.tile_labels(rows).tolist()
    pixels = iter(range(len(result.ok)))
    tiles, failures, members = [], [], []
    made: set[Path] = set()  # folders made by this unit (one mkdir per folder, not per tile)
    outputs: list[tuple[str, int, str]] = []  # (name under out, size, sha256) of every file
    for i, row in enumerate(rows.tolist()):
        base = tile_fields(index, row)
        slide = index.slides[base["slide_id"]]
        path = files[i]
        context_data: list[bytes] = []  # the encoded context tiles (webdataset)
        context_entries: list[dict[str, Any]] = []
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
                context_entries = context_meta(reader, row, j, result)
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
                if path.parent not in made:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    made.add(path.parent)
                write_file(path, data)
            name = relative_name(path, out)
            outputs.append((name, len(data), entry["sha256"]))
            tiles.append({**entry, "file": name, "member": ""})
        else:
            key = sample_key(index, row)
            meta = sample_meta(index, row, base, entry, context_entries, label_ids[i])
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
        shard, output = write_shard(out, unit.number, members, tiles)
        outputs.append(output)
    reader.close()
    record = {
        "unit": unit.number,
        "content": unit.content,
        "slides": unit.slides,
        "tiles": tiles,
        "failures": failures,
        "shard": shard,
        "outputs": outputs,
    }
    _append_part(out, record)  # last: marks it complete
    return record


def _encode_all(
    pixels: np.ndarray, ok: np.ndarray, options: ExportOptions, threads: int
) -> dict[int, bytes]:
    """Encoded bytes of every tile read without failure, by position."""
    todo = np.flatnonzero(ok).tolist()
    if threads < 2 or len(todo) < 2:
        return {j: _encode(pixels[j], options) for j in todo}
    with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="wsi-encode") as pool:
        return dict(zip(todo, pool.map(lambda j: _encode(pixels[j], options), todo), strict=True))
