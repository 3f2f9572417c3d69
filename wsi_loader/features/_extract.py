"""Per-slide features for slide-level (MIL) training, in CLAM's and TRIDENT's h5 layout.

A frozen encoder turns every tile of a slide into an embedding, once; attention-MIL models then
train on each slide's bag of embeddings. The pass itself (reading, the model, checks of its
outputs, resuming, ranks, timeouts) is `wsi_loader.models`; model specs are
`wsi_loader.models`. This module is the h5 writer.

Output, per slide: ``DIR/<slide name>.h5`` (the slide file's stem, as CLAM and TRIDENT name
them) with ``features`` (N x D float32) and ``coords`` (N x 2 int64, level-0 x, y), attributes
``patch_size`` and ``patch_level`` (on the file and on ``coords``, where CLAM reads them),
``patch_size_level0`` (the tile's edge in level-0 pixels, there too, as TRIDENT writes it),
``mpp``, ``model``, ``generation`` and ``content``; and ``DIR/features.json`` (model, dims,
counts, failures). With context scales (``context=``), the same model encodes each tile's
co-centred context tiles: ``features_ctx1``... beside ``features``, or concatenated into it,
as the file's ``context`` attribute says. A slide's file is written under a temporary name
and renamed when complete; a rerun skips slides whose file holds the same content (slide
version, tiles, model weights, context layout). Tiles that fail to read are left out and listed
with their reason; a slide whose features are not finite (NaN, Inf) is not written and is
listed under ``failed_slides``.

Under ``torchrun`` (``torch.distributed`` initialised), ranks split the slides (balanced by
tile count, each slide on exactly one rank) and each writes its own; rank 0 writes
``features.json`` once every rank is done.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from wsi_loader.config import DatasetConfig, validate
from wsi_loader.dataset._context import recorded_context
from wsi_loader.errors import ConfigError
from wsi_loader.files import write_file
from wsi_loader.index._naming import file_text, h5_file_names
from wsi_loader.index._table import SlideIndex
from wsi_loader.models._content import bind_pass
from wsi_loader.models._pass import (
    BatchTransform,
    PassOptions,
    PassReport,
    SlideOutputs,
    open_view,
    run_pass,
    slides_with_tiles,
)
from wsi_loader.models._pass_files import (
    claim_folder,
    gather_parts,
    remove_stale_files,
    temporary_path,
    write_json,
)
from wsi_loader.models._specs import Model, as_model, load_model, model_from

log = logging.getLogger(__name__)

FEATURES_JSON = "features.json"
# the names this module had before model loading and the pass moved out of it
Encoder = Model
FeatureReport = PassReport


def load_encoder(spec: str) -> Model:
    """A model spec (see `wsi_loader.models`) with its classification head removed."""
    return load_model(spec, head="remove")


encoder_from = model_from


def extract(
    index: SlideIndex | str | os.PathLike[str],
    model: str | nn.Module | Model,
    out: str | os.PathLike[str],
    *,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    dtype: str = "float32",
    workers: int | None = None,
    split: str | None = None,
    root: str | None = None,
    missing_slides: str = "raise",
    progress: bool = False,
    quarantine: str | os.PathLike[str] | None = None,
    timeout: float = 0,
    batch_transform: BatchTransform | None = None,
    stain: Any = None,
    context: Sequence[tuple[float, int]] | None = None,
    context_features: str = "separate",
    overwrite: bool = False,
    runner: Any = None,
) -> PassReport:
    """Features of every tile of every slide of ``index`` (``split``) into ``out``.

    ``model``: a spec (see `wsi_loader.models`; the classification head is removed), an
    ``nn.Module`` or a `Model`. ``device``: default CUDA when available. ``dtype``: the
    compute precision (autocast on CUDA, and bfloat16 autocast on CPU); features are stored as
    float32. ``quarantine``: the file failed reads go to (see `TileDataset`). ``timeout``
    (seconds; needs workers): when no batch comes for that long (a read that hangs on a share
    that stopped answering), the slides being read are left unwritten (``incomplete``, with
    the reason) and the others go on in fresh workers; 0 waits forever. ``batch_transform``:
    run by the reading processes on each uint8 NHWC batch (see `TileDataset`). ``stain``:
    transforms of `wsi_loader.stain` (``Normalize("macenko")``...) applied on ``device``
    before the encoder; part of what a slide's file records, so changing them recomputes it.
    ``runner``: where the batches are read and the model run instead of here
    (`wsi_loader.ray.RayPass`: on a Ray cluster); the files are written here, the same.

    ``context=[(mpp, size), ...]`` (default: the index's ``index --context``; ``[]`` none)
    also encodes every tile's co-centred context tiles with the same model (resized to its
    input like the tiles, and given their tile's stain transforms).
    ``context_features="separate"``: ``features`` holds the tiles' own features as without
    context (what CLAM and TRIDENT read), and ``features_ctx1``, ``features_ctx2``... (N x D
    each) those of each scale; ``"concat"``: ``features`` is ``[tile | ctx1 | ...]``
    (N x (1 + scales) D), one vector per tile for dual-stream MIL. The file's ``context``
    attribute (JSON) names the scales and the layout, which are part of its content.

    A folder holding the features of a run with other options (model, weights, precision,
    preprocessing, stain, context) is refused (`ConfigError`, nothing changed) unless
    ``overwrite`` (then the files of slides this run does not write are removed); a folder
    another run is writing is refused.
    """
    if context_features not in CONTEXT_LAYOUTS:
        raise ConfigError(
            f"context_features must be one of {CONTEXT_LAYOUTS}",
            key="context_features",
            value=context_features,
        )
    options = PassOptions.pick(locals())
    options.check()
    try:
        import h5py  # noqa: F401
    except ImportError as exc:
        raise ConfigError("feature extraction needs h5py: pip install 'wsi_loader[h5]'") from exc
    encoder = as_model(model, head="remove")
    view = open_view(index, options)
    options.context = (
        recorded_context(view)
        if context is None
        else validate(DatasetConfig, {"context": list(context)}).context or []
    )
    if context_features == "concat" and not options.context:
        raise ConfigError(
            "context_features 'concat' (--context-features concat) needs context tiles, and "
            "there are no context scales: none given (context=, --context) and none in the "
            "index (index --context)",
            path=str(view.path),
            key="context_features",
            value=context_features,
        )
    layout = context_layout(options.context, context_features)
    out_path = Path(out)
    slide_ids = slides_with_tiles(view)
    writer = FeatureWriter(out_path, view, h5_file_names(view, slide_ids), encoder, layout)
    bound = bind_pass(view, encoder, writer, options)
    keep = set(writer.names.values())
    with claim_folder(
        out_path, "features", bound.options(), overwrite, lambda: _clear(out_path, keep)
    ):
        remove_stale_files(out_path)
        report = run_pass(view, encoder, encoder.model, writer, options, "features", bound)
        _write_summary(out_path, view, slide_ids, writer.names, encoder, report, layout)
    return report


extract_features = extract  # the name `wsi_loader` exports


CONTEXT_LAYOUTS = ("separate", "concat")


def context_layout(scales: Sequence[tuple[float, int]], mode: str) -> dict[str, Any] | None:
    """What a feature file says of its context features (its ``context`` attribute), None
    without context scales."""
    if not scales:
        return None
    return {
        "layout": mode,
        "scales": [{"mpp": mpp, "size": size} for mpp, size in scales],
        "datasets": (
            ["features"]
            if mode == "concat"
            else ["features"] + [f"features_ctx{k}" for k in range(1, len(scales) + 1)]
        ),
    }


class FeatureWriter:
    """One h5 file per slide (see the module's docstring)."""

    def __init__(
        self,
        out: Path,
        view: SlideIndex,
        names: dict[int, str],
        model: Model,
        layout: dict[str, Any] | None = None,
    ) -> None:
        self.out, self.view, self.names, self.model = out, view, names, model
        self.layout = layout
        # part of each slide's content; nothing without context (the digests of files
        # written before context tiles stay valid)
        self.settings: list[Any] = [] if layout is None else [json.dumps(layout, sort_keys=True)]

    def is_complete(self, slide_id: int, contents: tuple[str, ...]) -> bool:
        return _stored_content(self.out / self.names[slide_id]) in contents

    def write(self, outputs: SlideOutputs, content: str) -> None:
        import h5py

        view, sid = self.view, outputs.slide_id
        record = view.slides[sid]
        cols = view.columns
        rows = outputs.rows
        coords = np.stack(
            [np.asarray(cols["l0_x"][rows], np.int64), np.asarray(cols["l0_y"][rows], np.int64)],
            axis=1,
        ).reshape(-1, 2)
        attrs = {
            "patch_size": int(record.read_size or 0),
            "patch_level": int(record.read_level or 0),
            "tile_size": int(view.params.get("tile_size", 0)),
            # the tile's edge in level-0 pixels (TRIDENT's name): what slide encoders that
            # place tiles on a grid (TITAN, Prov-GigaPath) divide coordinates by
            "patch_size_level0": round((record.read_size or 0) * (record.read_downsample or 1.0)),
            "mpp": float(record.tile_mpp) if record.tile_mpp else float("nan"),
            "model": self.model.spec,
            "generation": str(view.meta.get("generation")),
            "slide": file_text(record.path),
            "content": content,
        }
        features, context = outputs.values, outputs.context
        if self.layout is not None:
            attrs["context"] = json.dumps(self.layout, sort_keys=True)
            if self.layout["layout"] == "concat":
                features, context = np.concatenate([features, *context], axis=1), []
        path = self.out / self.names[sid]
        buf = io.BytesIO()  # (see files.write_file)
        with h5py.File(buf, "w") as h5:
            h5.create_dataset("features", data=features)
            for k, scale_features in enumerate(context, start=1):  # the "separate" layout
                scale = h5.create_dataset(f"features_ctx{k}", data=scale_features)
                scale.attrs.update(self.layout["scales"][k - 1] if self.layout else {})
            coords_ds = h5.create_dataset("coords", data=coords)
            for key in ("patch_size", "patch_level", "patch_size_level0"):
                coords_ds.attrs[key] = attrs[key]
            h5.attrs.update(attrs)
        write_file(path, buf.getvalue(), temporary_path(path))


def _clear(out: Path, keep: set[str]) -> None:
    """Before a run that replaces another's features (``overwrite``): the files its
    features.json lists that this run does not write (those it writes are written again
    unless their content is this run's), and features.json."""
    try:
        slides = json.loads((out / FEATURES_JSON).read_text(encoding="utf-8")).get("slides", {})
    except (OSError, ValueError, AttributeError):
        slides = {}
    for entry in slides.values() if isinstance(slides, dict) else ():
        name = entry.get("file") if isinstance(entry, dict) else None
        if isinstance(name, str) and name not in keep and "/" not in name and name.endswith(".h5"):
            (out / name).unlink(missing_ok=True)
    (out / FEATURES_JSON).unlink(missing_ok=True)


def _stored_content(path: Path) -> str | None:
    """The ``content`` attribute of a complete feature file, None if absent or unreadable."""
    if not path.is_file():
        return None
    import h5py

    try:
        with h5py.File(path, "r") as h5:
            value = h5.attrs.get("content")
            return str(value) if value is not None else None
    except (OSError, KeyError):
        return None


def _write_summary(
    out: Path,
    view: SlideIndex,
    slide_ids: list[int],
    names: dict[int, str],
    encoder: Model,
    report: PassReport,
    layout: dict[str, Any] | None = None,
) -> None:
    """Each rank writes its part; rank 0 joins them into features.json once all are there."""
    parts = gather_parts(out, "features", report.part())
    if parts is None:
        return
    slides: dict[str, dict[str, Any]] = {}
    dim = next((p["dim"] for p in parts if p["dim"]), None)
    if dim is not None and layout is not None and layout["layout"] == "concat":
        dim *= 1 + len(layout["scales"])  # the width of `features`: tiles and each scale
    for sid in slide_ids:
        file = out / names[sid]
        if not file.is_file():  # left for the next run (see "incomplete")
            continue
        count, width = _shape(file)
        slides[view.slides[sid].path] = {"file": names[sid], "features": count}
        if dim is None and count:
            dim = width
    summary = {
        "model": encoder.spec,
        "dim": dim,
        "generation": view.meta.get("generation"),
        "patch_size": view.params.get("tile_size"),
        "stain": report.stain,
        "slides": slides,
        "written": sum(p["written"] for p in parts),
        "skipped": sum(p["skipped"] for p in parts),
        "tiles": sum(v["features"] for v in slides.values()),
        "failed": sum(p["failed"] for p in parts),
        "failures": [f for p in parts for f in p["failures"]],
        "incomplete": [i for p in parts for i in p["incomplete"]],
        "failed_slides": [f for p in parts for f in p["failed_slides"]],
        "written_by": {path: p["rank"] for p in parts for path in p["slides_written"]},
        "ranks": len(parts),
    }
    if layout is not None:
        summary["context"] = layout
    write_json(out / FEATURES_JSON, summary)


def _shape(path: Path) -> tuple[int, int]:
    import h5py

    with h5py.File(path, "r") as h5:
        shape = h5["features"].shape
        return int(shape[0]), int(shape[1])
