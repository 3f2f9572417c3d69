"""WebDataset tar shards: a sample's key and JSON (its context tiles' entries included) and
the shard of a unit's samples, written with deterministic bytes.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path
from typing import Any

from wsi_loader.dataset._reading import TileReader
from wsi_loader.files import write_file
from wsi_loader.index._naming import key_component
from wsi_loader.index._table import SlideIndex


def sample_key(index: SlideIndex, row: int) -> str:
    """The key of a tile's sample (its members are KEY.<ext>, KEY.json...)."""
    cols = index.columns
    sid = int(cols["slide_id"][row])
    stem = key_component(Path(index.slides[sid].path).stem)
    return f"s{sid:05d}_{stem}_x{int(cols['l0_x'][row])}_y{int(cols['l0_y'][row])}"


def sample_meta(
    index: SlideIndex,
    row: int,
    base: dict[str, Any],
    entry: dict[str, Any],
    context: list[dict[str, Any]],
    label_id: int,
) -> dict[str, Any]:
    """The JSON of a tile's sample: where it comes from, its labels (``label_id``: its
    `SlideIndex.tile_labels` entry) and split, the annotated classes' coverage and its
    ``context`` entries (`context_meta`)."""
    slide = index.slides[base["slide_id"]]
    meta = {
        "slide": slide.path,
        "slide_id": base["slide_id"],
        "x": base["x"],
        "y": base["y"],
        "level": base["level"],
        "read_size": entry["read_size"],
        "mpp": slide.tile_mpp,
        "label": entry["label"],
        "label_id": label_id,
        "slide_label": slide.label,
        "split": slide.split,
        "row": row,
    }
    if index.coverage is not None:
        meta["coverage"] = {
            name: round(float(value), 6)
            for name, value in zip(index.classes, index.coverage[row], strict=True)
        }
    if context:
        meta["context"] = context
    return meta


def context_meta(reader: TileReader, row: int, j: int, result: Any) -> list[dict[str, Any]]:
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


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # deterministic bytes
    tar.addfile(info, io.BytesIO(data))


def write_shard(
    out: Path,
    number: int,
    members: list[tuple[str, str, bytes, bytes, list[bytes]]],
    tiles: list[dict[str, Any]],
) -> tuple[dict[str, Any], tuple[str, int, str]]:
    """Write the shard of unit ``number``: ``members`` are its samples (key, image extension,
    encoded tile, JSON, encoded context tiles), ``tiles`` their manifest rows. Returns its
    entry of the report and its output (name, size, sha256)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, image_ext, data, meta_bytes, context_data in members:
            _tar_member(tar, f"{key}.{image_ext}", data)
            for k, tile in enumerate(context_data, start=1):
                _tar_member(tar, f"{key}.ctx{k}.{image_ext}", tile)
            _tar_member(tar, f"{key}.json", meta_bytes)
    name = f"shard-{number:06d}.tar"
    data = buf.getvalue()
    shard = {
        "file": name,
        "tiles": len(members),
        "bytes": len(data),
        "slides": len({t["slide_id"] for t in tiles}),
    }
    write_file(out / name, data)
    return shard, (name, len(data), hashlib.sha256(data).hexdigest())
