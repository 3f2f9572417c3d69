"""Whole-slide inference (`wsi_loader.predict`): tile probabilities, QuPath tile objects,
heatmaps and slide results.

The pass (reading in strip order, the model on the device, checks of its outputs, resuming,
ranks, timeouts) is `wsi_loader.models`; this module is its writer (`_summary` writes the
summary after it). Outputs, in the layout WSInfer users know, are described in `wsi_loader.predict`.

A slide is complete when its state file (``DIR/.predict-state/<slide>.json``, written last)
holds the slide's content digest and its CSV, GeoJSON and heatmap have the sizes it recorded;
a killed run leaves no state for the slide it was writing, so the next run writes that slide
again, byte for byte the same (a slide's batches do not depend on the other slides).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from wsi_loader.device._devices import resolve_device
from wsi_loader.errors import ConfigError, ModelOutputError
from wsi_loader.files import write_file
from wsi_loader.index._naming import h5_file_names
from wsi_loader.index._table import SlideIndex
from wsi_loader.models._content import bind_pass
from wsi_loader.models._pass import (
    BadOutputError,
    BatchTransform,
    PassOptions,
    SlideOutputs,
    open_view,
    output_rows,
    run_pass,
    slides_with_tiles,
)
from wsi_loader.models._pass_files import (
    claim_folder,
    remove_stale_files,
    temporary_path,
)
from wsi_loader.models._specs import Model, as_model, class_names_of
from wsi_loader.predict._heatmaps import MAX_PANELS, SlideHeatmap
from wsi_loader.predict._metrics import (
    SlideRule,
)
from wsi_loader.predict._outputs import (
    CSV_FOLDER,
    GEOJSON_FOLDER,
    HEATMAP_FOLDER,
    OLD_GEOJSON_SUFFIX,
    TilePredictions,
    slide_files,
)
from wsi_loader.predict._pictures import measured_mpp
from wsi_loader.predict._summary import (
    STATE_FOLDER,
    PredictReport,
    clear_outputs,
    read_state,
    write_summary,
)

log = logging.getLogger(__name__)

TTA: dict[str, int] = {"none": 1, "flips": 4, "d4": 8}  # views averaged per tile
MPP_TOLERANCE = 0.1  # a model's training MPP and the index's may differ this much unsaid


def predict(
    index: SlideIndex | str | os.PathLike[str],
    model: str | nn.Module | Model,
    out: str | os.PathLike[str],
    *,
    classes: list[str] | tuple[str, ...] | None = None,
    multi_label: bool = False,
    tta: str = "none",
    batch_size: int = 64,
    device: str | torch.device | None = None,
    dtype: str = "float32",
    workers: int | None = None,
    split: str | None = None,
    root: str | None = None,
    missing_slides: str = "raise",
    quarantine: str | os.PathLike[str] | None = None,
    timeout: float = 0,
    progress: bool = False,
    heatmaps: bool = True,
    heatmap_class: str | None = None,
    heatmap_size: int = 1024,
    slide_rule: str = "mean",
    top_k: int = 10,
    threshold: float = 0.5,
    batch_transform: BatchTransform | None = None,
    stain: Any = None,
    overwrite: bool = False,
    runner: Any = None,
) -> PredictReport:
    """Run ``model`` over every tile of ``index`` (``split``) and write ``out`` (see
    `wsi_loader.predict` for the files).

    ``model``: a spec (`wsi_loader.models`: torchvision:, timm:, package.module:callable, a
    TorchScript file with its JSON config), an ``nn.Module`` or a `Model`. Outputs are softmax
    probabilities (sigmoid with ``multi_label``, or for a single output). Class names come from
    ``classes``, the model's config, or the index's label names, in that order; a count that
    differs from the model's outputs is a `ConfigError` before any slide is read. ``tta``:
    ``flips`` averages the probabilities of 4 flips of each tile, ``d4`` of its 8 rotations and
    flips. Slide results: ``slide_rule`` (mean, max, topk with ``top_k``) and ``threshold``
    (see `wsi_loader.predict`). ``stain``: transforms of `wsi_loader.stain` applied on
    the device before the model (part of each slide's content). A folder holding the outputs
    of a run with other options (model, classes, multi_label, tta, heatmaps, slide results,
    stain...) is refused (`ConfigError`, nothing changed) unless ``overwrite``; a folder
    another run is writing is refused. The other options are those of
    `wsi_loader.features.extract`.
    """
    options = PassOptions.pick(locals())
    options.check()
    rule = SlideRule(slide_rule, top_k, threshold, multi_label)
    rule.check()
    if tta not in TTA:
        raise ConfigError(f"tta must be one of {sorted(TTA)}", key="tta", value=tta)
    if not 64 <= heatmap_size <= 8192:
        raise ConfigError("heatmap_size must be 64 to 8192 pixels", key="heatmap_size")
    loaded = as_model(model, head="keep")
    view = open_view(index, options)
    names = _class_names(loaded, view, classes, options)
    if heatmaps and heatmap_class is None and len(names) > MAX_PANELS:
        raise ConfigError(
            f"{len(names)} classes are too many heatmap panels: name one (heatmap_class) or "
            "draw none (heatmaps=False)",
            key="heatmap_class",
        )
    if heatmap_class is not None and heatmap_class not in names:
        raise ConfigError(f"no class {heatmap_class!r}: {list(names)}", key="heatmap_class")
    rule = rule.deciding(len(names))
    _check_resolution(loaded, view)
    out_path = Path(out)
    slide_ids = slides_with_tiles(view)
    stems = {sid: name[: -len(".h5")] for sid, name in h5_file_names(view, slide_ids).items()}
    writer = PredictionWriter(
        out_path, view, stems, names, heatmaps, heatmap_class, heatmap_size, multi_label, tta,
        rule.threshold,
    )  # fmt: skip
    bound = bind_pass(view, loaded, writer, options)
    run_options = {
        **bound.options(),
        "settings": None,  # the writer's, named:
        "classes": list(names),
        "multi_label": multi_label,
        "tta": tta,
        "heatmaps": [heatmaps, heatmap_class, heatmap_size],
        "slide_rule": [rule.rule, rule.top_k, rule.threshold],
    }
    with claim_folder(
        out_path,
        "predict",
        run_options,
        overwrite,
        lambda: clear_outputs(out_path, set(stems.values())),
    ):
        for folder in (
            out_path,
            *(out_path / f for f in (CSV_FOLDER, GEOJSON_FOLDER, STATE_FOLDER)),
        ):
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale_files(folder)
        if heatmaps:
            (out_path / HEATMAP_FOLDER).mkdir(exist_ok=True)
            remove_stale_files(out_path / HEATMAP_FOLDER)
        forward = _forward(loaded.model, tta, multi_label, len(names))
        done = run_pass(view, loaded, forward, writer, options, "predict", bound)
        report = PredictReport(**vars(done), classes=names)
        write_summary(out_path, view, slide_ids, stems, loaded, report, rule, tta)
    return report


def _class_names(
    model: Model, view: SlideIndex, given: list[str] | tuple[str, ...] | None, options: PassOptions
) -> tuple[str, ...]:
    """The class names, from the first source that has them, checked against the number of
    outputs the model gives for one blank tile (run here, before any slide is read)."""
    size = model.size or int(view.params.get("tile_size", 224))
    device = resolve_device(options.device)
    blank = torch.zeros(1, 3, size, size, device=device)
    try:
        with torch.inference_mode():
            outputs = output_rows(model.model.eval().to(device)(blank), 1).shape[1]
    except BadOutputError as exc:
        raise ModelOutputError(f"{exc} (on a blank tile)", model=model.spec, slides=[]) from None
    sources = [
        ("classes", class_names_of(list(given), "classes") if given else None),
        ("the model's config", model.classes),
        ("the index's label names", tuple(view.label_names) or None),
    ]
    for source, names in sources:
        if names is None:
            continue
        if len(names) != outputs:
            raise ConfigError(
                f"the model gives {outputs} outputs per tile but {source} name "
                f"{len(names)} classes ({', '.join(names[:12])}): give --classes with "
                f"{outputs} names",
                key="classes",
            )
        return tuple(names)
    return tuple(str(i) for i in range(outputs))  # prob_0, prob_1, ...


def _check_resolution(model: Model, view: SlideIndex) -> None:
    """Say when the index's tiles are not what the model was trained on (its config's MPP
    and patch size): every probability would be off."""
    mpp = view.params.get("mpp")
    if model.mpp and mpp and abs(float(mpp) / model.mpp - 1) > MPP_TOLERANCE:
        log.warning(
            "the model was trained at %g um/px (its config) but the index's tiles are at %g: "
            "build an index with --mpp %g",
            model.mpp,
            float(mpp),
            model.mpp,
        )
    size = view.params.get("tile_size")
    if model.patch_size and size and int(size) != model.patch_size:
        log.warning(
            "the model was trained on %d px patches (its config) but the index's tiles are "
            "%d px: build an index with --tile-size %d",
            model.patch_size,
            int(size),
            model.patch_size,
        )


def _views(image: torch.Tensor, tta: str) -> list[torch.Tensor]:
    """The tile batch as the model sees it under test-time augmentation."""
    if tta == "none":
        return [image]
    flips = [image, image.flip(-1), image.flip(-2), image.flip(-1, -2)]
    if tta == "flips":
        return flips
    turned = image.transpose(-1, -2)  # with the 4 flips: the 8 symmetries of a square
    return [*flips, turned, turned.flip(-1), turned.flip(-2), turned.flip(-1, -2)]


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over classes as `F.softmax` computes it (shift by the row maximum, exp, divide
    by the sum), in element-wise operations: on a CPU, `F.softmax` enters torch's intra-op
    thread pool even for (64, 2) logits, and right after the model's pass that waits on
    threads on a machine whose other cores are busy (the workers'): many times the cost of
    the element-wise form (benchmarks/README.md, "Softmax after the model")."""
    shifted = (logits - logits.amax(dim=1, keepdim=True)).exp()
    return shifted / shifted.sum(dim=1, keepdim=True)


def _forward(model: nn.Module, tta: str, multi_label: bool, classes: int) -> Any:
    def forward(image: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor | None = None
        for seen in _views(image, tta):
            logits = output_rows(model(seen), len(image)).float()
            if logits.shape[1] != classes:
                raise BadOutputError(
                    f"returned {logits.shape[1]} values per tile; it gave {classes} (one per "
                    "class) on a blank tile"
                )
            probs = torch.sigmoid(logits) if multi_label or classes == 1 else _softmax(logits)
            total = probs if total is None else total + probs
        assert total is not None
        return total / TTA[tta]

    return forward


class PredictionWriter:
    """A slide's CSV, GeoJSON and heatmap, then its state (see the module's docstring)."""

    def __init__(
        self,
        out: Path,
        view: SlideIndex,
        stems: dict[int, str],
        classes: tuple[str, ...],
        heatmaps: bool,
        heatmap_class: str | None,
        heatmap_size: int,
        multi_label: bool,
        tta: str,
        threshold: float = 0.5,
    ) -> None:
        self.out, self.view, self.stems, self.classes = out, view, stems, classes
        self.heatmaps, self.heatmap_class, self.heatmap_size = heatmaps, heatmap_class, heatmap_size
        self.settings: list[Any] = [list(classes), multi_label, tta]
        if heatmaps:
            self.settings.append([heatmap_class, heatmap_size])
        # a single output's tiles are classified by the threshold (in the GeoJSON): part of
        # its content; absent for other models (their files' digests stay valid)
        self.threshold = threshold if len(classes) == 1 else None
        if self.threshold is not None:
            self.settings.append({"threshold": self.threshold})

    def state_path(self, sid: int) -> Path:
        return self.out / STATE_FOLDER / f"{self.stems[sid]}.json"

    def files(self, sid: int) -> dict[str, Path]:
        files = slide_files(self.out, self.stems[sid])
        if not self.heatmaps:
            del files["heatmap"]
        return files

    def is_complete(self, slide_id: int, contents: tuple[str, ...]) -> bool:
        state = read_state(self.state_path(slide_id))
        if state is None or state.get("content") not in contents:
            return False
        sizes = state.get("sizes", {})
        return all(
            path.is_file() and path.stat().st_size == sizes.get(kind)
            for kind, path in self.files(slide_id).items()
        )

    def write(self, outputs: SlideOutputs, content: str) -> None:
        sid = outputs.slide_id
        record = self.view.slides[sid]
        cols = self.view.columns
        side = round((record.read_size or 0) * (record.read_downsample or 1.0))
        rows = outputs.rows
        boxes = np.stack(
            [
                np.asarray(cols["l0_x"][rows], np.int64),
                np.asarray(cols["l0_y"][rows], np.int64),
                np.full(len(rows), side, np.int64),
                np.full(len(rows), side, np.int64),
            ],
            axis=1,
        ).reshape(-1, 4)
        tiles = TilePredictions(boxes, outputs.values, self.classes)
        files = self.files(sid)
        data = {
            "csv": tiles.csv_bytes(),
            "geojson": tiles.geojson_bytes(self.stems[sid], threshold=self.threshold),
        }
        for kind in ("csv", "geojson"):
            write_file(files[kind], data[kind], temporary_path(files[kind]))
        files["geojson"].with_suffix(OLD_GEOJSON_SUFFIX).unlink(missing_ok=True)
        sizes = {kind: len(value) for kind, value in data.items()}
        if self.heatmaps:
            failed = [(f["x"], f["y"], side, side) for f in outputs.failures]
            heatmap = SlideHeatmap(
                self.view.slide_path(sid),
                boxes,
                outputs.values,
                self.classes,
                failed=failed,
                show=[self.heatmap_class] if self.heatmap_class else None,
                mpp=record.mpp if measured_mpp(record.mpp, record.mpp_source) else None,
                title=self.stems[sid],
                max_size=self.heatmap_size,
            )
            png = heatmap._repr_png_()
            write_file(files["heatmap"], png, temporary_path(files["heatmap"]))
            sizes["heatmap"] = len(png)
        state = {
            "slide": record.path,
            "content": content,
            "sizes": sizes,
            "tiles": len(rows),
            "failures": outputs.failures,
        }
        path = self.state_path(sid)  # last: the slide is complete once this is there
        write_file(path, json.dumps(state, sort_keys=True).encode(), temporary_path(path))
