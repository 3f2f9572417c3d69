"""After the pass: a predict run's summary. Each slide's state file (`read_state`), then on
rank 0 ``slides.csv`` (the slide rule over each slide's tile probabilities), ``metrics.json``
(slide and tile metrics when labels name the classes) and ``predict.json`` (the model, the
classes, counts, failures and versions: `PredictReport`)."""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from wsi_loader.files import csv_text, write_file
from wsi_loader.index._table import SlideIndex
from wsi_loader.models._pass import PassReport
from wsi_loader.models._pass_files import gather_parts, write_json
from wsi_loader.models._specs import Model, weights_digest
from wsi_loader.predict._metrics import (
    TILE_BOOTSTRAP_ROUNDS,
    SlideRule,
    aggregate,
    class_of_label,
    metrics,
    metrics_available,
    predicted,
    slides_csv,
)
from wsi_loader.predict._outputs import (
    METRICS_JSON,
    OLD_GEOJSON_SUFFIX,
    PREDICT_JSON,
    SLIDES_CSV,
    TilePredictions,
    slide_files,
)

STATE_FOLDER = ".predict-state"


@dataclass
class PredictReport(PassReport):
    classes: tuple[str, ...] = ()
    slide_results: list[dict[str, Any]] = field(default_factory=list)  # rank 0: slides.csv
    metrics: dict[str, Any] | None = None  # rank 0, when slides or tiles have labels


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def clear_outputs(out: Path, keep: set[str]) -> None:
    """Before a run that replaces another's outputs (``overwrite``): the files of every slide
    whose stem is not in ``keep`` (a slide of this run keeps its files when their content is
    this run's, else they are written again), and the summary files."""
    for state in (out / STATE_FOLDER).glob("*.json"):
        stem = state.name[: -len(".json")]
        if stem in keep:
            continue
        files = slide_files(out, stem)
        for path in (*files.values(), files["geojson"].with_suffix(OLD_GEOJSON_SUFFIX)):
            path.unlink(missing_ok=True)
        state.unlink(missing_ok=True)
    for name in (SLIDES_CSV, METRICS_JSON, PREDICT_JSON):
        (out / name).unlink(missing_ok=True)


def write_summary(
    out: Path,
    view: SlideIndex,
    slide_ids: list[int],
    stems: dict[int, str],
    model: Model,
    report: PredictReport,
    rule: SlideRule,
    tta: str,
) -> None:
    """Rank 0, once every rank is done: slides.csv, metrics.json and predict.json, from the
    files of every complete slide (written by this run or an earlier one)."""
    parts = gather_parts(out, "predict", report.part())
    if parts is None:
        return
    key = _summary_key(out, view, slide_ids, stems, report.classes, rule)
    if sum(p["written"] for p in parts) == 0 and _kept_summary(out, key, report):
        summary = _run_metadata(view, model, report, parts, rule, tta, report.slide_results)
        _finish_metadata(out, summary, key, view, slide_ids, stems)
        return
    classes = report.classes
    rows, failures, slide_truth, slide_scores = [], [], [], []
    tile_truth: list[int] = []
    tile_scores: list[np.ndarray] = []
    tile_groups: list[int] = []
    names = view.label_names
    for sid in slide_ids:
        record = view.slides[sid]
        state = read_state(out / STATE_FOLDER / f"{stems[sid]}.json")
        files = slide_files(out, stems[sid])
        if state is None or not files["csv"].is_file():
            continue  # not done (see incomplete, failed_slides)
        tiles = TilePredictions.read_csv(files["csv"])
        failures.extend(state.get("failures", []))
        stats = aggregate(tiles.probabilities, rule)
        rows.append(
            {
                "slide": record.path,
                "name": stems[sid],
                "label": record.label,
                "tiles": len(tiles.boxes),
                "failed": len(state.get("failures", [])),
                "stats": stats,
                "predicted": predicted(stats["score"], classes, rule),
            }
        )
        truth = class_of_label(record.label, classes)
        if truth is not None and not view.labels_from_annotations and len(tiles.boxes):
            slide_truth.append(truth)
            slide_scores.append(stats["score"])
        if view.labels_from_annotations:
            labels = _tile_labels(view, sid, tiles.boxes)
            known = [class_of_label(names[i], classes) if i >= 0 else None for i in labels]
            keep = [i for i, c in enumerate(known) if c is not None]
            tile_truth.extend(c for c in known if c is not None)
            tile_scores.append(tiles.probabilities[keep])
            tile_groups.extend([sid] * len(keep))
    report.slide_results = rows
    write_file(out / SLIDES_CSV, slides_csv(rows, classes, rule))
    results: dict[str, Any] = {}
    if (slide_truth or tile_truth) and not metrics_available():
        slide_truth, tile_truth = [], []
    if slide_truth:
        results["slides"] = metrics(np.array(slide_truth), np.array(slide_scores), classes, rule)
    if tile_truth:
        results["tiles"] = metrics(
            np.array(tile_truth),
            np.concatenate(tile_scores).astype(np.float64),
            classes,
            rule,
            groups=np.array(tile_groups),
            rounds=TILE_BOOTSTRAP_ROUNDS,
        )
    if results:
        results["rule"] = rule.describe()
        write_json(out / METRICS_JSON, results)
        report.metrics = results
    else:
        (out / METRICS_JSON).unlink(missing_ok=True)  # a previous run's, of other slides
    summary = _run_metadata(view, model, report, parts, rule, tta, rows)
    summary["failures"], summary["failed"] = failures, len(failures)
    summary["summary_key"] = key
    write_json(out / PREDICT_JSON, summary)


def _summary_key(
    out: Path,
    view: SlideIndex,
    slide_ids: list[int],
    stems: dict[int, str],
    classes: tuple[str, ...],
    rule: SlideRule,
) -> str:
    """What slides.csv and metrics.json are made of: each slide's state (its outputs'
    content and sizes), its label, the classes and the rule; equal keys, equal files."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps([list(classes), rule.describe(), rule.threshold, rule.top_k]).encode())
    if view.labels_from_annotations:  # tile labels: the index generation's
        digest.update(str(view.meta.get("generation")).encode())
    for sid in slide_ids:
        state = read_state(out / STATE_FOLDER / f"{stems[sid]}.json") or {}
        record = view.slides[sid]
        entry = [record.path, stems[sid], record.label, state.get("content"), state.get("sizes")]
        digest.update(json.dumps(entry, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _kept_summary(out: Path, key: str, report: PredictReport) -> bool:
    """Whether slides.csv and metrics.json of ``out`` were made of what they would be made
    of now (``key``, recorded in predict.json): a rerun with nothing to do then keeps them
    (reading every slide's CSV again costs most of a run) and reads the results back."""
    try:
        before = json.loads((out / PREDICT_JSON).read_text(encoding="utf-8"))
        if not isinstance(before, dict) or before.get("summary_key") != key:
            return False
        with open(out / SLIDES_CSV, newline="", encoding="utf-8") as fh:
            rows = [{k: csv_text(v or "") for k, v in row.items()} for row in csv.DictReader(fh)]
        metrics = None
        if (out / METRICS_JSON).is_file():
            metrics = json.loads((out / METRICS_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    report.slide_results = [
        {"slide": r.get("slide"), "name": r.get("name"), "label": r.get("label") or None,
         "tiles": int(r.get("tiles") or 0), "predicted": r.get("predicted", "")}
        for r in rows
    ]  # fmt: skip
    report.metrics = metrics
    return True


def _finish_metadata(
    out: Path,
    summary: dict[str, Any],
    key: str,
    view: SlideIndex,
    slide_ids: list[int],
    stems: dict[int, str],
) -> None:
    """predict.json of a run that kept the summary: failures from the slides' states."""
    failures: list[dict[str, Any]] = []
    for sid in slide_ids:
        state = read_state(out / STATE_FOLDER / f"{stems[sid]}.json")
        failures.extend(state.get("failures", []) if state else [])
    summary["failures"], summary["failed"] = failures, len(failures)
    summary["summary_key"] = key
    write_json(out / PREDICT_JSON, summary)


def _tile_labels(view: SlideIndex, sid: int, boxes: np.ndarray) -> list[int]:
    """The annotation label id of each tile (by its position), -1 when none."""
    starts = view.slide_starts()
    rows = np.arange(int(starts[sid]), int(starts[sid + 1]))
    cols = view.columns
    where = {
        (int(x), int(y)): int(r)
        for x, y, r in zip(cols["l0_x"][rows], cols["l0_y"][rows], rows, strict=True)
    }
    found = [where.get((int(x), int(y)), -1) for x, y in boxes[:, :2].tolist()]
    labels = view.tile_labels(np.array([r for r in found if r >= 0], dtype=np.int64)).tolist()
    it = iter(labels)
    return [next(it) if r >= 0 else -1 for r in found]


def _run_metadata(
    view: SlideIndex,
    model: Model,
    report: PredictReport,
    parts: list[dict[str, Any]],
    rule: SlideRule,
    tta: str,
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {
        "model": model.spec,
        "weights_digest": weights_digest(model.model),
        "preprocessing": {"size": model.size, "mean": model.mean, "std": model.std},
        "classes": list(report.classes),
        "activation": "sigmoid" if rule.multi_label or len(report.classes) == 1 else "softmax",
        "tta": tta,
        "stain": report.stain,  # the transforms, targets resolved (None: none)
        "slide_rule": {
            "rule": rule.rule,
            "top_k": rule.top_k,
            "threshold": rule.threshold,
            "predicted": rule.describe(),
        },
        "index": str(view.path),
        "generation": view.meta.get("generation"),
        "tile_size": view.params.get("tile_size"),
        "mpp": view.params.get("mpp"),
        "slides": {r["slide"]: {"name": r["name"], "tiles": r["tiles"]} for r in rows},
        "written": sum(p["written"] for p in parts),
        "skipped": sum(p["skipped"] for p in parts),
        "tiles": sum(r["tiles"] for r in rows),
        "incomplete": [i for p in parts for i in p["incomplete"]],
        "failed_slides": [f for p in parts for f in p["failed_slides"]],
        "written_by": {path: p["rank"] for p in parts for path in p["slides_written"]},
        "ranks": len(parts),
        "versions": {
            name: version(name)
            for name in ("wsi_loader", "torch", "numpy", "openslide-python", "scikit-learn")
        },
    }
