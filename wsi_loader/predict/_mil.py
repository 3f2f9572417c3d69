"""Slide predictions of a MIL model over feature bags (``predict FEATURES_DIR --mil-model``).

Each slide's bag (the h5 files `wsi_loader.features.extract` writes, read by
`FeatureBagDataset`) goes to the model as one padded batch, as `pad_bags` gives it in training:
``model(features)`` with features (1, N, D), or ``model(features, mask)`` when its forward takes
two arguments (mask (1, N), all true). It returns logits ((1, C) or (C,)), or ``(logits,
attention)`` with N attention values per tile (or K x N: K maps, one per class when K = C).
Attention heatmaps are rank-normalised per slide, as CLAM draws them (each tile's rank among the
slide's tiles, from 1/N to 1), and also written per tile:
``DIR/attention-csv/<slide>.csv`` (``minx,miny,width,height,attention[_<class>],rank...``).
``DIR/slides.csv`` has the slide probabilities (``prob_<class>``), the label and the predicted
class; ``DIR/metrics.json`` the metrics when labels name classes; ``DIR/predict.json`` the run.
"""

from __future__ import annotations

import csv
import inspect
import io
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from wsi_loader.dataset._feature_bags import FeatureBagDataset
from wsi_loader.device._devices import resolve_device
from wsi_loader.errors import ConfigError, ModelOutputError
from wsi_loader.files import csv_row, write_file
from wsi_loader.index._inputs import slide_name
from wsi_loader.index._naming import bag_stem
from wsi_loader.index._table import SlideIndex
from wsi_loader.models._pass_files import claim_folder, write_json
from wsi_loader.models._specs import Model, as_model, class_names_of, weights_digest
from wsi_loader.predict._heatmaps import SlideHeatmap
from wsi_loader.predict._metrics import (
    SlideRule,
    average_ranks,
    class_of_label,
    metrics,
    metrics_available,
    predicted,
)
from wsi_loader.predict._outputs import HEATMAP_FOLDER, METRICS_JSON, PREDICT_JSON, SLIDES_CSV
from wsi_loader.predict._pictures import measured_mpp
from wsi_loader.predict._summary import PredictReport
from wsi_loader.slides._open import open_slide

log = logging.getLogger(__name__)

ATTENTION_FOLDER = "attention-csv"


def predict_bags(
    features: str | os.PathLike[str],
    model: str | nn.Module | Model,
    out: str | os.PathLike[str],
    *,
    index: SlideIndex | str | os.PathLike[str] | None = None,
    labels: str | os.PathLike[str] | None = None,
    split: str | None = None,
    root: str | None = None,
    device: str | torch.device | None = None,
    classes: list[str] | tuple[str, ...] | None = None,
    multi_label: bool = False,
    heatmaps: bool = True,
    heatmap_class: str | None = None,
    heatmap_size: int = 1024,
    slide_rule: str = "mean",
    top_k: int = 10,
    threshold: float = 0.5,
    overwrite: bool = False,
) -> PredictReport:
    """Run a MIL ``model`` over each slide's bag of ``features`` into ``out`` (see the module's
    docstring). ``index`` (the index the features came from) finds the slides for heatmaps
    and gives labels; without it, the slide paths stored in the feature files are used and
    ``labels`` (CSV or none) gives labels. ``slide_rule``/``top_k`` are not used (the model
    makes the slide call); ``threshold`` decides multi-label calls and a single output's.
    ``out`` is held and kept to one run's options as `wsi_loader.predict.predict` holds it
    (``overwrite``)."""
    rule = SlideRule("mean", top_k, threshold, multi_label)
    rule.check()
    opened = None
    if index is not None:
        opened = index if isinstance(index, SlideIndex) else SlideIndex.open(index, root=root)
    bags = FeatureBagDataset(features, index=opened, labels=labels, split=split)
    loaded = as_model(model, head="keep")
    run_on = resolve_device(device)
    net = loaded.model.eval().to(run_on)
    two_args = _takes_mask(net)
    out_path = Path(out)
    run_options = {
        "mil_model": loaded.spec,
        "weights": weights_digest(loaded.model),
        "features": os.fspath(features),
        "classes": list(classes) if classes else None,
        "multi_label": multi_label,
        "heatmaps": [heatmaps, heatmap_class, heatmap_size],
        "threshold": threshold,
    }
    with claim_folder(out_path, "predict --mil-model", run_options, overwrite, lambda: None):
        report = _predict_bags(
            bags, loaded, net, two_args, run_on, opened, out_path, features, classes,
            multi_label, heatmaps, heatmap_class, heatmap_size, rule,
        )  # fmt: skip
    return report


def _predict_bags(
    bags: FeatureBagDataset,
    loaded: Model,
    net: nn.Module,
    two_args: bool,
    run_on: torch.device,
    opened: SlideIndex | None,
    out_path: Path,
    features: str | os.PathLike[str],
    classes: list[str] | tuple[str, ...] | None,
    multi_label: bool,
    heatmaps: bool,
    heatmap_class: str | None,
    heatmap_size: int,
    rule: SlideRule,
) -> PredictReport:
    """`predict_bags` in the folder it holds."""
    (out_path / ATTENTION_FOLDER).mkdir(parents=True, exist_ok=True)
    if heatmaps:
        (out_path / HEATMAP_FOLDER).mkdir(exist_ok=True)
    names: tuple[str, ...] | None = None
    if classes:
        names = class_names_of(list(classes), "classes")
    names = names or loaded.classes or (tuple(bags.label_names) or None)
    report = PredictReport()
    report.slides = len(bags)
    rows, truth, scores = [], [], []
    for i in range(len(bags)):
        bag = bags[i]
        slide = str(bag["slide"])
        logits, attention = _run(net, bag["features"].to(run_on), two_args, loaded.spec, slide)
        if names is None:
            names = tuple(str(c) for c in range(len(logits)))
        if len(logits) != len(names):
            raise ConfigError(
                f"the MIL model gives {len(logits)} outputs but there are {len(names)} classes "
                f"({', '.join(names[:12])}): give --classes with {len(logits)} names",
                key="classes",
            )
        if not torch.isfinite(logits).all() or (
            attention is not None and not torch.isfinite(attention).all()
        ):
            why = "the model returned NaN or infinite values; not written"
            log.error("%s: %s", slide, why)
            report.failed_slides.append(
                {"slide": slide, "tiles": len(bag["coords"]), "reason": why}
            )
            continue
        probs = torch.sigmoid(logits) if multi_label or len(names) == 1 else F.softmax(logits, 0)
        p = probs.cpu().numpy().astype(np.float64)
        label_name = bags.label_names[bag["label"]] if bag["label"] >= 0 else None
        rows.append({"slide": slide, "label": label_name, "tiles": len(bag["coords"]), "p": p})
        rows[-1]["predicted"] = predicted(p, names, rule.deciding(len(names)))
        known = class_of_label(label_name, names)
        if known is not None:
            truth.append(known)
            scores.append(p)
        if attention is not None:
            where = _slide_file(opened, bags, i, slide)
            side = _tile_side(opened, bags.files[i], where, slide)
            boxes = np.concatenate(
                [bag["coords"].numpy(), np.full((len(bag["coords"]), 2), side)], axis=1
            )
            _write_attention(out_path, slide, boxes, attention.cpu().numpy(), names)
            if heatmaps and where is not None:
                _heatmap(out_path, slide, where, boxes, attention.cpu().numpy(), names,
                         heatmap_class, heatmap_size, opened)  # fmt: skip
        report.written += 1
        report.tiles += len(bag["coords"])
        report.written_slides.append(slide)
    report.classes = names or ()
    write_file(out_path / SLIDES_CSV, _slides_csv(rows, report.classes))
    report.slide_results = [{"name": r["slide"], **r} for r in rows]
    if truth and metrics_available():
        report.metrics = {
            "slides": metrics(
                np.array(truth), np.array(scores), report.classes, rule.deciding(len(names or ()))
            ),
            "rule": "the MIL model's slide probabilities",
        }
        write_json(out_path / METRICS_JSON, report.metrics)
    write_json(
        out_path / PREDICT_JSON,
        {
            "mil_model": loaded.spec,
            "weights_digest": weights_digest(loaded.model),
            "features": os.fspath(features),
            "classes": list(report.classes),
            "activation": "sigmoid" if multi_label or len(report.classes) == 1 else "softmax",
            "slides": {r["slide"]: {"tiles": r["tiles"]} for r in rows},
            "written": report.written,
            "failed_slides": report.failed_slides,
        },
    )
    return report


def _takes_mask(model: nn.Module) -> bool:
    """Whether the model's forward takes (features, mask), as models trained on `pad_bags`
    batches do."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # TorchScript and builtins may have none to show
        return False
    required = [
        p
        for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(required) >= 2


def _run(
    model: nn.Module, features: torch.Tensor, two_args: bool, spec: str, slide: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits (C,), attention (K, N) or None) of one bag, checked."""
    n = len(features)
    batch = features[None]
    with torch.inference_mode():
        output = (
            model(batch, torch.ones(1, n, dtype=torch.bool, device=batch.device))
            if two_args
            else model(batch)
        )

    def bad(what: str) -> ModelOutputError:
        return ModelOutputError(what, model=spec, slides=[slide])

    attention = None
    if isinstance(output, tuple | list):
        if len(output) < 2:
            raise bad(f"returned a {type(output).__name__} of {len(output)}")
        output, attention = output[0], output[1]
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        raise bad("the logits must be a floating-point tensor, (1, C) or (C,)")
    if (output.ndim == 2 and output.shape[0] != 1) or output.ndim > 2 or output.ndim == 0:
        raise bad(f"returned logits of shape {tuple(output.shape)}; expected (1, C) or (C,)")
    if attention is not None:
        if not isinstance(attention, torch.Tensor) or attention.numel() % max(n, 1):
            shape = tuple(attention.shape) if isinstance(attention, torch.Tensor) else attention
            raise bad(f"returned attention {shape} for a bag of {n} tiles: expected N or K x N")
        attention = attention.float().reshape(-1, n)
    return output.float().reshape(-1), attention


def _slide_file(
    index: SlideIndex | None, bags: FeatureBagDataset, i: int, slide: str
) -> str | None:
    """The slide file of bag ``i``: through the index, else the path stored in its h5 file."""
    if index is not None:
        for sid, record in enumerate(index.slides):
            if slide_name(record.path) == slide:
                return index.slide_path(sid)
    import h5py

    with h5py.File(bags.files[i], "r") as h5:
        stored = h5.attrs.get("slide")
    path = os.fsdecode(stored) if isinstance(stored, bytes | str) else None
    hint = "no heatmap; pass --index (the index the features came from)"
    if path is None:  # another tool's file
        log.warning(
            "%s: %s names no slide file (no 'slide' attribute): %s", slide, bags.files[i].name,
            hint,
        )  # fmt: skip
        return None
    if not os.path.isfile(path):
        log.warning("%s: slide file not found (%s): %s", slide, path, hint)
        return None
    return path


def _tile_side(index: SlideIndex | None, file: Path, slide_file: str | None, slide: str) -> int:
    """The level-0 side of the bag's tiles: patch_size at patch_level (the h5 attributes)."""
    import h5py

    with h5py.File(file, "r") as h5:
        size = int(h5["coords"].attrs.get("patch_size", 0))
        level = int(h5["coords"].attrs.get("patch_level", 0))
    downsample = 1.0
    if level and slide_file is not None:
        reader = open_slide(slide_file)
        try:
            downsample = float(reader.meta.level_downsamples[level])
        finally:
            reader.close()
    return round(size * downsample)


def _columns(names: tuple[str, ...], maps: int) -> list[str]:
    return (
        [f"attention_{c}" for c in names]
        if maps == len(names) and maps > 1
        else ["attention" if maps == 1 else f"attention_{k}" for k in range(maps)]
    )


def _ranks(attention: np.ndarray) -> np.ndarray:
    """Each tile's rank among the slide's tiles, 1/N to 1 (CLAM's percentiles), per map."""
    return np.stack([average_ranks(a) / len(a) for a in attention]) if attention.size else attention


def _write_attention(
    out: Path, slide: str, boxes: np.ndarray, attention: np.ndarray, names: tuple[str, ...]
) -> None:
    columns = _columns(names, len(attention))
    ranks = _ranks(attention)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["minx", "miny", "width", "height", *columns, *(f"{c}_rank" for c in columns)])
    raw = attention.astype(np.float32).astype(str).T.tolist()
    ranked = ranks.astype(np.float32).astype(str).T.tolist()
    for box, a, r in zip(boxes.tolist(), raw, ranked, strict=True):
        writer.writerow([*box, *a, *r])
    write_file(out / ATTENTION_FOLDER / f"{bag_stem(slide)}.csv", text.getvalue().encode())


def _heatmap(
    out: Path,
    slide: str,
    where: str,
    boxes: np.ndarray,
    attention: np.ndarray,
    names: tuple[str, ...],
    heatmap_class: str | None,
    size: int,
    index: SlideIndex | None,
) -> None:
    columns = _columns(names, len(attention))
    show = None
    if heatmap_class is not None and f"attention_{heatmap_class}" in columns:
        show = [f"attention_{heatmap_class}"]
    mpp = None
    if index is not None:
        record = next((r for r in index.slides if slide_name(r.path) == slide), None)
        if record is not None and measured_mpp(record.mpp, record.mpp_source):
            mpp = record.mpp
    picture = SlideHeatmap(
        where, boxes, _ranks(attention).T, columns, show=show, mpp=mpp, title=slide,
        label="attention (rank in the slide)", max_size=size,
    )  # fmt: skip
    picture.save(out / HEATMAP_FOLDER / f"{bag_stem(slide)}.png")


def _slides_csv(rows: list[dict[str, Any]], classes: tuple[str, ...]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["slide", "label", "tiles", *(f"prob_{c}" for c in classes), "predicted"])
    # text cells quoted (csv_row): a slide named =cmd|calc!A0 is not a formula
    for row in rows:
        probs = [f"{v:.6g}" for v in row["p"]]
        cells = csv_row([row["slide"], row["label"] or "", row["predicted"]])
        writer.writerow([*cells[:2], row["tiles"], *probs, cells[2]])
    return text.getvalue().encode("utf-8")
