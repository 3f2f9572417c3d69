"""Per-slide features for slide-level (MIL) training, in CLAM's and TRIDENT's h5 layout.

A frozen encoder turns every tile of a slide into an embedding, once; attention-MIL models then
train on each slide's bag of embeddings. The read path is `make_loader` (decode in workers,
batches in shared memory) and `DeviceLoader` (copy on a side stream, normalise on the device),
so the device never waits on per-item Python work.

Output, per slide: ``DIR/<slide name>.h5`` (the slide file's stem, as CLAM and TRIDENT name
them) with ``features`` (N x D float32) and ``coords`` (N x 2 int64, level-0 x, y), attributes
``patch_size`` and ``patch_level`` (on the file and on ``coords``, where CLAM reads them),
``mpp``, ``model``, ``generation`` and ``content``; and ``DIR/features.json`` (model, dims,
counts, failures). A slide's file is written under a temporary name and renamed when complete;
a rerun skips slides whose file holds the same content (slide version, tiles, model weights).
Tiles that fail to read are left out and listed with their reason.

Under ``torchrun`` (``torch.distributed`` initialised), ranks split the slides (balanced by
tile count, each slide on exactly one rank) and each writes its own; rank 0 writes
``features.json`` once every rank is done.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F  # noqa: N812

from wsi_loader.config import DatasetConfig, validate
from wsi_loader.dataset.context import recorded_context
from wsi_loader.dataset.loader import make_loader
from wsi_loader.dataset.tiles import open_for_reading
from wsi_loader.errors import ConfigError, LoaderTimeoutError
from wsi_loader.files import replacing, write_file
from wsi_loader.gpu import DeviceLoader
from wsi_loader.index.table import SlideIndex, SlideRecord
from wsi_loader.naming import file_text, h5_file_names
from wsi_loader.parallel import progress_bar

log = logging.getLogger(__name__)

FEATURES_JSON = "features.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_HEADS = ("fc", "classifier", "heads", "head")  # torchvision's classification heads


@dataclass
class Encoder:
    """A frozen model and the input it expects: ``mean``/``std`` in [0, 1] units (None: plain
    /255) and ``size``, the input edge tiles are resized to on the device (None: as read)."""

    model: nn.Module
    spec: str
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    size: int | None = None


@dataclass
class FeatureReport:
    slides: int = 0  # slides of this run (all ranks)
    written: int = 0  # files written by this rank
    skipped: int = 0  # complete files kept by this rank
    tiles: int = 0  # features written by this rank
    failed: int = 0  # tiles left out by this rank
    dim: int | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    written_slides: list[str] = field(default_factory=list)  # stored paths, by this rank
    # slides left unwritten for the next run: reads failed for reasons that are not the data's
    # (a changed or missing slide, resources), so a file would wrongly count as complete
    incomplete: list[dict[str, Any]] = field(default_factory=list)


def load_encoder(spec: str) -> Encoder:
    """``torchvision:NAME`` (weights from the local torch hub cache only), ``timm:NAME`` (when
    timm is installed) or ``package.module:callable``. The callable returns an ``nn.Module``,
    or ``(module, preprocessing)`` / a dict with ``model`` and optional ``mean``, ``std``,
    ``size`` keys."""
    kind, sep, name = spec.partition(":")
    if not sep or not name:
        raise ConfigError(
            "a model is torchvision:NAME, timm:NAME or package.module:callable",
            key="model",
            value=spec,
        )
    if kind == "torchvision":
        return _torchvision(name, spec)
    if kind == "timm":
        return _timm(name, spec)
    return _callable(kind, name, spec)


def _import_failed(package: str, spec: str, exc: BaseException) -> ConfigError:
    """A ConfigError for a model package that is missing or does not load: pip's torchvision
    wheel on a CPU build of torch (or another torch version) fails on import with a
    RuntimeError, and timm imports torchvision."""
    if isinstance(exc, ModuleNotFoundError) and exc.name == package:
        extra = "'wsi_loader[gpu]'" if package == "torchvision" else package
        return ConfigError(f"{spec} needs {package} (pip install {extra})", key="model", value=spec)
    return ConfigError(
        f"{spec}: {package} cannot be imported ({type(exc).__name__}: {exc}); a torchvision "
        f"built for another torch than this one ({torch.__version__}) fails this way: install "
        "the torchvision release made for it, from the same index as torch",
        key="model",
        value=spec,
    )


def _torchvision(name: str, spec: str) -> Encoder:
    try:
        from torchvision.models import get_model, get_model_weights
    except Exception as exc:  # missing, or built for another torch (a RuntimeError)
        raise _import_failed("torchvision", spec, exc) from exc
    try:
        weights = get_model_weights(name).DEFAULT
    except (ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"torchvision has no model {name!r}", key="model", value=spec) from exc
    file = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name
    if not file.is_file():
        raise ConfigError(
            f"the weights of {name} are not in the torch hub cache ({file}); download them "
            f"once on a machine with network access (torchvision.models.get_model({name!r}, "
            f"weights='DEFAULT')) and copy the file there, or point TORCH_HOME at a cache "
            "that has them, or pass package.module:callable returning your own model",
            key="model",
            value=spec,
        )
    model = get_model(name, weights=weights)
    for head in _HEADS:
        if isinstance(getattr(model, head, None), nn.Module):
            setattr(model, head, nn.Identity())
            break
    transform = weights.transforms()
    return Encoder(
        model,
        spec,
        tuple(transform.mean),
        tuple(transform.std),
        int(transform.crop_size[0]),
    )


def _timm(name: str, spec: str) -> Encoder:
    try:
        import timm  # type: ignore[import-not-found]
    except Exception as exc:  # missing, or its torchvision built for another torch
        raise _import_failed("timm", spec, exc) from exc
    try:
        model = timm.create_model(name, pretrained=True, num_classes=0)
    except Exception as exc:  # unknown name, no network for the weights...
        raise ConfigError(f"timm cannot load {name!r}: {exc}", key="model", value=spec) from exc
    config = timm.data.resolve_data_config({}, model=model)
    return Encoder(
        model, spec, tuple(config["mean"]), tuple(config["std"]), config["input_size"][1]
    )


def _callable(module_name: str, attribute: str, spec: str) -> Encoder:
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"cannot import {spec}: {exc} (the module must be importable: on PYTHONPATH, or "
            "in the current folder for the wsi-loader command)",
            key="model",
            value=spec,
        ) from exc
    if not callable(target):
        raise ConfigError(f"{spec} is not callable", key="model", value=spec)
    made = target()
    return encoder_from(made, spec)


def encoder_from(made: Any, spec: str = "module") -> Encoder:
    """An `Encoder` from a module, a ``(module, preprocessing)`` pair or a dict."""
    options: dict[str, Any] = {}
    if isinstance(made, tuple) and len(made) == 2:
        made, options = made
    elif isinstance(made, dict):
        options = dict(made)
        made = options.pop("model", None)
    if not isinstance(made, nn.Module):
        raise ConfigError(
            f"{spec} must give an nn.Module (or (module, preprocessing), or a dict with "
            f"'model'), got {type(made).__name__}",
            key="model",
            value=spec,
        )
    unknown = set(options) - {"mean", "std", "size"}
    if unknown:
        raise ConfigError(
            f"{spec}: unknown preprocessing keys {sorted(unknown)} (mean, std, size)", key="model"
        )
    mean, std = options.get("mean"), options.get("std")
    return Encoder(
        made,
        spec,
        tuple(mean) if mean is not None else None,
        tuple(std) if std is not None else None,
        int(options["size"]) if options.get("size") else None,
    )


def _weights_digest(model: nn.Module) -> str:
    """A digest of the model's parameters and buffers: another checkpoint under the same spec
    is other content."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode("utf-8", "surrogateescape"))
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def assign_slides(tiles: Sequence[int], world_size: int) -> list[int]:
    """Rank of each slide: largest first to the least loaded rank (the same on every rank)."""
    load = [0] * world_size
    owner = [0] * len(tiles)
    for sid in sorted(range(len(tiles)), key=lambda s: (-tiles[s], s)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[sid] = rank
        load[rank] += tiles[sid]
    return owner


def extract(
    index: SlideIndex | str | os.PathLike[str],
    model: str | nn.Module | Encoder,
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
    context: Sequence[tuple[float, int]] | None = None,
    context_features: str = "separate",
) -> FeatureReport:
    """Features of every tile of every slide of ``index`` (``split``) into ``out``.

    ``model``: a spec (see `load_encoder`), an ``nn.Module`` or an `Encoder`. ``device``:
    default CUDA when available. ``dtype``: the compute precision (autocast on CUDA, and
    bfloat16 autocast on CPU); features are stored as float32. ``quarantine``: the file
    failed reads go to (see `TileDataset`). ``timeout`` (seconds; needs workers): when no
    batch comes for that long (a read that hangs on a share that stopped answering), the
    slides being read are left unwritten (``incomplete``, with the reason) and the others
    go on in fresh workers; 0 waits forever.

    ``context=[(mpp, size), ...]`` (default: the index's ``index --context``; ``[]`` none)
    also encodes every tile's co-centred context tiles with the same model (resized to its
    input like the tiles). ``context_features="separate"``: ``features`` holds the tiles' own
    features as without context (what CLAM and TRIDENT read), and ``features_ctx1``,
    ``features_ctx2``... (N x D each) those of each scale; ``"concat"``: ``features`` is
    ``[tile | ctx1 | ...]`` (N x (1 + scales) D), one vector per tile for dual-stream MIL.
    The file's ``context`` attribute (JSON) names the scales and the layout.
    """
    if context_features not in CONTEXT_LAYOUTS:
        raise ConfigError(
            f"context_features must be one of {CONTEXT_LAYOUTS}",
            key="context_features",
            value=context_features,
        )
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}", key="dtype", value=dtype)
    try:
        import h5py  # noqa: F401
    except ImportError as exc:
        raise ConfigError("feature extraction needs h5py: pip install 'wsi_loader[h5]'") from exc
    encoder = (
        model
        if isinstance(model, Encoder)
        else load_encoder(model)
        if isinstance(model, str)
        else encoder_from(model)
    )
    options = DatasetConfig(
        split=split,
        root=root,
        missing_slides=missing_slides,  # type: ignore[arg-type]
        quarantine=None if quarantine is None else os.fspath(quarantine),
    )
    view = open_for_reading(index, options)
    scales = (
        recorded_context(view)
        if context is None
        else validate(DatasetConfig, {"context": list(context)}).context or []
    )
    layout = _context_layout(scales, context_features)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    rank, world = _rank()
    _remove_stale_files(out_path)

    starts = view.slide_starts()
    counts = np.diff(starts)
    slide_ids = [int(s) for s in np.flatnonzero(counts > 0)]
    names = h5_file_names(view, slide_ids)
    owner = assign_slides([int(counts[s]) for s in slide_ids], world)
    mine = [sid for sid, r in zip(slide_ids, owner, strict=True) if r == rank]
    weights = _weights_digest(encoder.model)
    content = {sid: _content(view, sid, starts, encoder, weights, dtype, layout) for sid in mine}
    todo = [sid for sid in mine if _stored_content(out_path / names[sid]) != content[sid]]
    report = FeatureReport(slides=len(slide_ids), skipped=len(mine) - len(todo))

    model_on = encoder.model.eval().to(device)
    if device.type == "cuda":
        model_on = model_on.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    total = int(sum(counts[s] for s in todo))
    with progress_bar(total, "tile", "features", progress and bool(todo)) as bar:
        while todo:
            rows = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in todo])
            loader = make_loader(
                view,
                batch_size,
                sampler=rows.tolist(),
                num_workers=workers,
                pin_memory=device.type == "cuda",
                persistent_workers=False,
                timeout=timeout,
                context=scales,
            )
            batches = DeviceLoader(
                loader, device, mean=encoder.mean, std=encoder.std, channels_last=True
            )
            done: set[int] = set()
            try:
                for sid, parts in _per_slide(batches, model_on, encoder, dtype, device, bar):
                    _write_slide(
                        out_path,
                        names[sid],
                        view,
                        sid,
                        parts,
                        encoder,
                        content[sid],
                        report,
                        layout,
                    )
                    done.add(sid)
                todo = []
            except LoaderTimeoutError as exc:
                todo = _after_timeout(exc, [s for s in todo if s not in done], view, counts, report)
                bar.n = total - int(sum(counts[s] for s in todo))  # a slide begun starts over
                bar.refresh()
    _write_summary(out_path, view, slide_ids, names, encoder, report, rank, world)
    return report


def _after_timeout(
    exc: LoaderTimeoutError,
    todo: list[int],
    view: SlideIndex,
    counts: npt.NDArray[np.int64],
    report: FeatureReport,
) -> list[int]:
    """The slides still to do after no batch came within the timeout: the ones the workers
    were reading are left for the next run (``incomplete``), or the first slide not done when
    the workers were stuck elsewhere (so that every round ends at least one slide)."""
    stuck = [s for s in exc.slide_ids if s in todo] or todo[:1]
    for sid in stuck:
        path = view.slides[sid].path
        why = (
            f"no batch within timeout={exc.seconds:g} s while reading it (a read that hangs: "
            "is its storage answering?); not written, run again"
        )
        log.warning("%s: %s", path, why)
        report.incomplete.append({"slide": path, "tiles": int(counts[sid]), "reason": why})
    return [s for s in todo if s not in stuck]


extract_features = extract  # the name `wsi_loader` exports


_TMP_MARK = ".tmp-"


def _remove_stale_files(out: Path) -> None:
    """Files of runs killed on this machine (their process is gone): a killed run leaves its
    slide under a temporary name, never under the final one."""
    host = socket.gethostname()
    for path in out.glob(f".*{_TMP_MARK}{host}-*"):
        try:
            pid = int(path.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            continue


CONTEXT_LAYOUTS = ("separate", "concat")


def _context_layout(scales: Sequence[tuple[float, int]], mode: str) -> dict[str, Any] | None:
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


def _content(
    view: SlideIndex,
    sid: int,
    starts: np.ndarray,
    encoder: Encoder,
    weights: str,
    dtype: str,
    layout: dict[str, Any] | None = None,
) -> str:
    """What a slide's file holds: slide version, its tiles, the model and its weights, and
    the context scales and their layout."""
    rows = slice(int(starts[sid]), int(starts[sid + 1]))
    cols = view.columns
    digest = hashlib.blake2b(digest_size=16)
    record = view.slides[sid]
    header = [record.path, record.fingerprint, encoder.spec, weights, dtype, encoder.size]
    if layout is not None:
        header.append(json.dumps(layout, sort_keys=True))
    digest.update(json.dumps([*header, encoder.mean, encoder.std]).encode())
    for name in ("l0_x", "l0_y", "level", "read_size"):
        digest.update(np.ascontiguousarray(cols[name][rows]).tobytes())
    return digest.hexdigest()


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


@dataclass
class _Slide:
    features: list[np.ndarray] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    failed_rows: list[np.ndarray] = field(default_factory=list)
    context: list[list[np.ndarray]] = field(default_factory=list)  # per scale, like features


def _per_slide(
    batches: DeviceLoader,
    model: nn.Module,
    encoder: Encoder,
    dtype: str,
    device: torch.device,
    bar: Any,
) -> Iterator[tuple[int, _Slide]]:
    """Run the model over the batches; yield each slide's features once all its rows passed
    (rows come in slide order)."""
    current: int | None = None
    parts = _Slide()
    autocast = dtype != "float32"

    def encode(image: torch.Tensor) -> np.ndarray:
        if encoder.size is not None and image.shape[-1] != encoder.size:
            image = F.interpolate(
                image, size=(encoder.size, encoder.size), mode="bilinear", antialias=True
            )
        with (
            torch.inference_mode(),
            torch.autocast(device.type, dtype=DTYPES[dtype], enabled=autocast),
        ):
            features = model(image)
        encoded: np.ndarray = features.float().reshape(len(image), -1).cpu().numpy()
        return encoded

    for batch in batches:
        features = encode(batch["image"])
        context = [encode(tiles) for tiles in batch.get("context") or ()]
        ok = batch["ok"].cpu().numpy().astype(bool)
        rows = batch["row"].cpu().numpy()
        slides = batch["slide_id"].cpu().numpy()
        for sid in np.unique(slides):  # in order of first appearance: rows are slide-sorted
            sid_i = int(sid)
            if current is not None and sid_i != current:
                yield current, parts
                parts = _Slide()
            current = sid_i
            here = slides == sid
            parts.features.append(features[here & ok])
            if not parts.context:
                parts.context = [[] for _ in context]
            for kept, scale in zip(parts.context, context, strict=True):
                kept.append(scale[here & ok])
            parts.rows.append(rows[here & ok])
            parts.failed_rows.append(rows[here & ~ok])
        bar.update(len(rows))
    if current is not None:
        yield current, parts


def _write_slide(
    out: Path,
    name: str,
    view: SlideIndex,
    sid: int,
    parts: _Slide,
    encoder: Encoder,
    content: str,
    report: FeatureReport,
    layout: dict[str, Any] | None = None,
) -> None:
    import h5py

    record = view.slides[sid]
    cols = view.columns
    failed = np.concatenate(parts.failed_rows) if parts.failed_rows else np.zeros(0, np.int64)
    reasons, slide_fault = _failure_reasons(view, record) if len(failed) else ({}, None)
    xy = [(int(cols["l0_x"][r]), int(cols["l0_y"][r])) for r in failed.tolist()]
    unexplained = sum(key not in reasons for key in xy)
    if unexplained:
        why = slide_fault or "reads failed for want of resources (not recorded as data errors)"
        log.warning(
            "%s: not written, %d tiles failed: %s; run again", record.path, unexplained, why
        )
        report.incomplete.append({"slide": record.path, "tiles": unexplained, "reason": why})
        return
    rows = np.concatenate(parts.rows) if parts.rows else np.zeros(0, np.int64)
    dim = next((p.shape[1] for p in parts.features if p.ndim == 2), report.dim or 0)
    features = (
        np.concatenate(parts.features).astype(np.float32)
        if parts.features
        else np.zeros((0, dim), np.float32)
    )
    context = [
        np.concatenate(scale).astype(np.float32) if scale else np.zeros((0, dim), np.float32)
        for scale in parts.context
    ]
    if layout is not None and layout["layout"] == "concat":
        features = np.concatenate([features, *context], axis=1)
        context = []
    coords = np.stack(
        [np.asarray(cols["l0_x"][rows], np.int64), np.asarray(cols["l0_y"][rows], np.int64)],
        axis=1,
    ).reshape(-1, 2)
    attrs = {
        "patch_size": int(record.read_size or 0),
        "patch_level": int(record.read_level or 0),
        "tile_size": int(view.params.get("tile_size", 0)),
        "mpp": float(record.tile_mpp) if record.tile_mpp else float("nan"),
        "model": encoder.spec,
        "generation": str(view.meta.get("generation")),
        "slide": file_text(record.path),
        "content": content,
    }
    if layout is not None:
        attrs["context"] = json.dumps(layout, sort_keys=True)
    path = out / name
    tmp = out / f".{name}{_TMP_MARK}{socket.gethostname()}-{os.getpid()}"
    buf = io.BytesIO()  # (see files.write_file)
    with h5py.File(buf, "w") as h5:
        h5.create_dataset("features", data=features)
        for k, scale_features in enumerate(context, start=1):  # the "separate" layout
            scale = h5.create_dataset(f"features_ctx{k}", data=scale_features)
            scale.attrs.update(layout["scales"][k - 1] if layout else {})
        coords_ds = h5.create_dataset("coords", data=coords)
        for key in ("patch_size", "patch_level"):
            coords_ds.attrs[key] = attrs[key]
        h5.attrs.update(attrs)
    write_file(path, buf.getvalue(), tmp)
    for x, y in xy:  # data errors of this version of the slide: left out for good
        report.failures.append({"slide": record.path, "x": x, "y": y, "reason": reasons[(x, y)]})
    report.written += 1
    report.written_slides.append(record.path)
    report.tiles += len(features)
    report.failed += len(failed)
    report.dim = report.dim or (int(features.shape[1]) if features.size else None)


def _failure_reasons(
    view: SlideIndex, record: SlideRecord
) -> tuple[dict[tuple[int, int], str], str | None]:
    """What the workers recorded in the quarantine for this version of a slide: the error of
    each tile that failed on its data, and the slide fault (missing, replaced), if any."""
    reasons: dict[tuple[int, int], str] = {}
    slide_fault = None
    for entry in view.quarantine.read():
        if entry.get("path") != record.path:
            continue
        if entry.get("kind", "tile") == "slide":
            slide_fault = str(entry.get("error") or "the slide could not be read")
        elif entry.get("fingerprint") in (None, record.fingerprint):
            reasons[(int(entry["x"]), int(entry["y"]))] = str(entry.get("error") or "read failed")
    return reasons, slide_fault


def _write_summary(
    out: Path,
    view: SlideIndex,
    slide_ids: list[int],
    names: dict[int, str],
    encoder: Encoder,
    report: FeatureReport,
    rank: int,
    world: int,
) -> None:
    """Each rank writes its part; rank 0 joins them into features.json once all are there."""
    part = {
        "rank": rank,
        "written": report.written,
        "skipped": report.skipped,
        "tiles": report.tiles,
        "failed": report.failed,
        "dim": report.dim,
        "failures": report.failures,
        "slides_written": report.written_slides,
        "incomplete": report.incomplete,
    }
    part_file = out / f".features-rank{rank}.json"
    _write_json(part_file, part)
    if world > 1:
        dist.barrier()
    if rank != 0:
        return
    parts = [json.loads((out / f".features-rank{r}.json").read_text()) for r in range(world)]
    slides: dict[str, dict[str, Any]] = {}
    dim = next((p["dim"] for p in parts if p["dim"]), None)
    for sid in slide_ids:
        file = out / names[sid]
        if not file.is_file():  # left for the next run (see "incomplete")
            continue
        count = _count(file)
        slides[view.slides[sid].path] = {"file": names[sid], "features": count}
        if dim is None and count:
            dim = _dim(file)
    summary = {
        "model": encoder.spec,
        "dim": dim,
        "generation": view.meta.get("generation"),
        "patch_size": view.params.get("tile_size"),
        "slides": slides,
        "written": sum(p["written"] for p in parts),
        "skipped": sum(p["skipped"] for p in parts),
        "tiles": sum(v["features"] for v in slides.values()),
        "failed": sum(p["failed"] for p in parts),
        "failures": [f for p in parts for f in p["failures"]],
        "incomplete": [i for p in parts for i in p["incomplete"]],
        "written_by": {path: p["rank"] for p in parts for path in p["slides_written"]},
        "ranks": world,
    }
    _write_json(out / FEATURES_JSON, summary)
    for r in range(world):
        (out / f".features-rank{r}.json").unlink(missing_ok=True)


def _count(path: Path) -> int:
    import h5py

    with h5py.File(path, "r") as h5:
        return int(h5["features"].shape[0])


def _dim(path: Path) -> int:
    import h5py

    with h5py.File(path, "r") as h5:
        return int(h5["features"].shape[1])


def _write_json(path: Path, payload: Any) -> None:
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
