"""One embedding per slide from a features folder: a registry slide encoder
(`wsi_loader.models` ``slide_encoder``) over each slide's h5 file, for users who train a linear
probe instead of MIL.

Input: the per-slide h5 files of ``wsi-loader features --model NAME`` (``features`` N x D,
``coords`` N x 2 level-0 x, y, the ``model`` attribute ``encoder:NAME``), or TRIDENT's files
of the same layout. Every file must come from the patch encoder the slide encoder was trained
on: a file from another is refused before anything runs, naming the file, its encoder and the
one expected. Slide encoders that read positions also need the level-0 patch size
(``patch_size_level0``, TRIDENT's attribute name, which `features` writes too; else
``patch_size_level0=``) and the resolution they were trained at.

Output, in ``out``: ``slide_embeddings.h5`` with ``embeddings`` (S x dim float32), ``slides``
(S names, the features files' stems), ``content`` (what each row was computed from) and
attributes ``slide_encoder``, ``patch_encoder``, ``dim``, ``weights``; and
``slide_embeddings.csv``, one line per input file: slide, row in ``embeddings`` (empty when
none), width, tiles, patch encoder, slide encoder, status (``ok``, ``no tiles``, or
``failed: reason``) and the features file. Both are written whole under a temporary name and
renamed, every `FLUSH_SECONDS` and at the end, so a killed run keeps what it had; a rerun
skips slides whose row holds the same content (features file, slide encoder and weights).
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsi_loader.errors import ConfigError
from wsi_loader.files import csv_row, write_file
from wsi_loader.models._slide_encoders import (
    SlideEncoder,
    SlideRecipe,
    build_slide_encoder,
    slide_encoder,
    slide_recipe_of,
)
from wsi_loader.models._specs import weights_digest

log = logging.getLogger(__name__)

EMBEDDINGS_H5 = "slide_embeddings.h5"
EMBEDDINGS_CSV = "slide_embeddings.csv"
CSV_COLUMNS = (
    "slide",
    "row",
    "width",
    "tiles",
    "patch_encoder",
    "slide_encoder",
    "status",
    "features_file",
)
FLUSH_SECONDS = 30.0  # a killed run loses at most this much work


@dataclass
class SlideEmbeddingReport:
    """What a run did: slides embedded now, kept from an earlier run, without tiles, failed."""

    written: int = 0
    skipped: int = 0
    empty: int = 0
    failures: list[dict[str, str]] = field(default_factory=list)


@dataclass
class _Source:
    """One features file as read for the checks (its arrays are read when embedded)."""

    path: Path
    model: str
    tiles: int
    mpp: float | None
    patch_size: int | None
    patch_size_level0: int | None
    content: str | None
    error: str | None = None


def embed_slides(
    features: str | os.PathLike[str],
    model: str | SlideEncoder,
    out: str | os.PathLike[str],
    *,
    weights: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    patch_size_level0: int | None = None,
    overwrite: bool = False,
    download: bool = True,
) -> SlideEmbeddingReport:
    """Embed every slide of the features folder ``features`` with the slide encoder
    ``model`` (a registry name, or a `SlideEncoder` already loaded) into ``out`` (see the
    module's docstring). ``patch_size_level0``: the tiles' edge in level-0 pixels, for files
    that do not say it. A folder holding another slide encoder's embeddings is refused unless
    ``overwrite``.
    """
    folder = Path(features)
    sources = [_read_source(p) for p in _feature_files(folder)]
    loaded: SlideEncoder | None = None
    if isinstance(model, SlideEncoder):
        loaded, recipe = model, model.recipe
    else:
        recipe = slide_recipe_of(model)
        build_slide_encoder(recipe)  # a listed encoder that cannot run says so first
    _check_sources(recipe, sources, patch_size_level0)  # before the weights are read
    encoder = loaded or slide_encoder(
        recipe.name, None if weights is None else Path(weights), download=download
    )
    run_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    encoder = encoder.to(run_device).eval()
    digest = weights_digest(encoder)
    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    kept = _earlier_rows(out_path, recipe, digest, overwrite)
    rows: dict[str, dict[str, Any]] = {}
    report = SlideEmbeddingReport()
    last_flush = time.monotonic()
    for source in sources:
        content = _content(source, recipe, digest)
        earlier = kept.get(source.path.stem)
        if earlier is not None and earlier["content"] == content:
            rows[source.path.stem] = {**earlier, "source": source}
            report.skipped += 1
            continue
        row = _embed(encoder, source, content, patch_size_level0, run_device)
        rows[source.path.stem] = row
        if row["status"] == "ok":
            report.written += 1
        elif row["status"] == "no tiles":
            report.empty += 1
        else:
            report.failures.append({"slide": source.path.stem, "reason": row["status"]})
            log.warning("%s: %s", source.path, row["status"])
        if time.monotonic() - last_flush > FLUSH_SECONDS:
            _write(out_path, rows, recipe, digest)
            last_flush = time.monotonic()
    _write(out_path, rows, recipe, digest)
    return report


def _feature_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise ConfigError(
            f"{folder} is not a features folder (the --out of `wsi-loader features`)",
            key="features",
            value=str(folder),
        )
    # hidden names are files being written (see models._pass_files.temporary_path)
    files = sorted(p for p in folder.glob("*.h5") if not p.name.startswith("."))
    files = [p for p in files if p.name != EMBEDDINGS_H5]
    if not files:
        raise ConfigError(
            f"{folder} holds no per-slide features files (*.h5)",
            key="features",
            value=str(folder),
        )
    return files


def _attr(h5: Any, name: str) -> Any:
    """An attribute of the file, else of its ``coords`` (where CLAM and TRIDENT put some)."""
    if name in h5.attrs:
        return h5.attrs[name]
    if "coords" in h5 and name in h5["coords"].attrs:
        return h5["coords"].attrs[name]
    return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if np.isfinite(number) and number > 0 else None


def _read_source(path: Path) -> _Source:
    import h5py

    try:
        with h5py.File(path, "r") as h5:
            if "features" not in h5 or "coords" not in h5:
                raise KeyError("it has no 'features' or no 'coords' dataset")
            shape = h5["features"].shape
            if len(shape) != 2 or h5["coords"].shape != (shape[0], 2):
                raise ValueError(
                    f"features {shape} and coords {h5['coords'].shape} are not N x D and N x 2"
                )
            size0 = _number(_attr(h5, "patch_size_level0"))
            size = _number(_attr(h5, "tile_size")) or _number(_attr(h5, "patch_size"))
            return _Source(
                path,
                _text(_attr(h5, "model")) or "",
                int(shape[0]),
                _number(_attr(h5, "mpp")),
                None if size is None else int(size),
                None if size0 is None else int(size0),
                _text(h5.attrs.get("content")),
            )
    except (OSError, KeyError, ValueError) as exc:
        return _Source(path, "", 0, None, None, None, None, error=f"failed: unreadable ({exc})")


def _check_sources(
    recipe: SlideRecipe, sources: list[_Source], patch_size_level0: int | None
) -> None:
    """Refuse features from another patch encoder, or (for slide encoders reading positions)
    at another resolution or patch size, or without a level-0 patch size."""
    expected = f"encoder:{recipe.patch_encoder}"
    if patch_size_level0 is not None and not recipe.positions:
        raise ConfigError(
            f"patch_size_level0 (--patch-size-level0) is for slide encoders that read the "
            f"tiles' positions; {recipe.name} reads none (leave it out)",
            key="patch_size_level0",
            value=patch_size_level0,
        )
    for s in sources:
        if s.error is not None:
            continue
        if patch_size_level0 is not None and s.patch_size_level0 not in (None, patch_size_level0):
            raise ConfigError(
                f"{s.path} says its tiles are {s.patch_size_level0} level-0 px, not "
                f"patch_size_level0={patch_size_level0} (--patch-size-level0 is for files that "
                "do not say it: leave it out)",
                key="patch_size_level0",
                value=patch_size_level0,
            )
        if s.model.lower() != expected:
            raise ConfigError(
                f"{s.path} holds features of {s.model or 'an unnamed model'}, but slide encoder "
                f"{recipe.name} takes those of patch encoder {recipe.patch_encoder}: run "
                f"`wsi-loader features INDEX --model {recipe.patch_encoder} --out DIR` first",
                key="features",
                value=str(s.path),
            )
        problems = []
        if recipe.mpp is not None and s.mpp is not None and abs(s.mpp / recipe.mpp - 1) > 0.1:
            problems.append(f"tiles at {s.mpp:g} um/px, not {recipe.mpp:g}")
        if recipe.patch_size is not None and s.patch_size not in (None, recipe.patch_size):
            problems.append(f"{s.patch_size} px tiles, not {recipe.patch_size}")
        if recipe.positions and (s.patch_size_level0 or patch_size_level0) is None:
            problems.append("no patch_size_level0 (pass the tiles' level-0 edge)")
        if not problems:
            continue
        message = (
            f"{s.path}: {'; '.join(problems)}: slide encoder {recipe.name} was trained on "
            f"{recipe.patch_encoder} features of {recipe.patch_size} px tiles at "
            f"{recipe.mpp} um/px"
        )
        if recipe.positions:
            raise ConfigError(message, key="features", value=str(s.path))
        log.warning("%s", message)


def _content(source: _Source, recipe: SlideRecipe, digest: str) -> str:
    """What a slide's row is computed from: the features file's content (its ``content``
    attribute, else its size and modification time), the slide encoder and its weights."""
    h = hashlib.blake2b(digest_size=16)
    if source.content is not None:
        h.update(source.content.encode())
    else:
        stat = source.path.stat()
        h.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    h.update(f"{recipe.name}:{digest}".encode())
    return h.hexdigest()


def _embed(
    encoder: SlideEncoder,
    source: _Source,
    content: str,
    patch_size_level0: int | None,
    device: torch.device,
) -> dict[str, Any]:
    import h5py

    row: dict[str, Any] = {"source": source, "content": content, "embedding": None}
    if source.error is not None:
        return {**row, "status": source.error}
    if source.tiles == 0:
        return {**row, "status": "no tiles"}
    with h5py.File(source.path, "r") as h5:
        features = torch.from_numpy(np.asarray(h5["features"], dtype=np.float32))
        coords = torch.from_numpy(np.asarray(h5["coords"], dtype=np.int64))
    width = encoder.recipe.input_dim
    if features.shape[1] != width:
        return {**row, "status": f"failed: {features.shape[1]} wide features, not {width}"}
    try:
        with torch.inference_mode():
            out = encoder(
                features.to(device),
                coords.to(device),
                source.patch_size_level0 or patch_size_level0,
            )
    except ValueError as exc:  # this slide's input (tiles off the encoder's grid): recorded
        return {**row, "status": f"failed: {exc}"}
    embedding = out.float().reshape(-1).cpu().numpy()
    if not np.isfinite(embedding).all():
        return {**row, "status": "failed: the embedding is not finite"}
    return {**row, "status": "ok", "embedding": embedding}


def _earlier_rows(
    out: Path, recipe: SlideRecipe, digest: str, overwrite: bool
) -> dict[str, dict[str, Any]]:
    """The rows of an earlier run into ``out`` (by slide name), to keep those whose content
    is unchanged; another slide encoder's file is refused unless ``overwrite``."""
    import h5py

    path = out / EMBEDDINGS_H5
    if not path.is_file():
        return {}
    try:
        with h5py.File(path, "r") as h5:
            name = _text(h5.attrs.get("slide_encoder"))
            if name != recipe.name and not overwrite:
                raise ConfigError(
                    f"{path} holds the embeddings of slide encoder {name}, not {recipe.name}: "
                    "choose another output folder, or pass overwrite (--overwrite) to replace it",
                    key="out",
                    value=str(out),
                )
            slides = [_text(s) or "" for s in h5["slides"][()]]
            contents = [_text(c) or "" for c in h5["content"][()]]
            embeddings = np.asarray(h5["embeddings"], dtype=np.float32)
    except (OSError, KeyError) as exc:
        log.warning("%s cannot be read (%s): every slide is embedded again", path, exc)
        return {}
    return {
        s: {"content": c, "embedding": e, "status": "ok", "source": None}
        for s, c, e in zip(slides, contents, embeddings, strict=True)
    }


def _write(out: Path, rows: dict[str, dict[str, Any]], recipe: SlideRecipe, digest: str) -> None:
    """``slide_embeddings.h5`` and ``.csv`` from the rows so far, each written whole."""
    import h5py

    done = [name for name in sorted(rows) if rows[name]["status"] == "ok"]
    buf = io.BytesIO()
    with h5py.File(buf, "w") as h5:
        matrix = np.stack([rows[n]["embedding"] for n in done]) if done else None
        h5.create_dataset(
            "embeddings",
            data=matrix if matrix is not None else np.zeros((0, recipe.dim), np.float32),
        )
        text = h5py.string_dtype()
        h5.create_dataset("slides", data=np.array(done, dtype=object), dtype=text)
        h5.create_dataset(
            "content", data=np.array([rows[n]["content"] for n in done], dtype=object), dtype=text
        )
        h5.attrs.update(
            {
                "slide_encoder": recipe.name,
                "patch_encoder": recipe.patch_encoder,
                "dim": recipe.dim,
                "weights": digest,
            }
        )
    write_file(out / EMBEDDINGS_H5, buf.getvalue())
    position = {name: k for k, name in enumerate(done)}
    text_out = io.StringIO()
    writer = csv.writer(text_out)
    writer.writerow(CSV_COLUMNS)
    for name in sorted(rows):
        row, source = rows[name], rows[name]["source"]
        writer.writerow(
            csv_row(
                [
                    name,
                    position.get(name, ""),
                    recipe.dim if name in position else "",
                    "" if source is None else source.tiles,
                    recipe.patch_encoder,
                    recipe.name,
                    row["status"],
                    "" if source is None else str(source.path),
                ]
            )
        )
    write_file(out / EMBEDDINGS_CSV, text_out.getvalue().encode())
