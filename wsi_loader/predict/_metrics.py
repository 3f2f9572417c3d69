"""From tile probabilities to slide results, and metrics against labels (scikit-learn's).

Per slide and class: the mean, the max, the mean of the top ``k`` tiles, and the share of tiles
at or above ``threshold``. The slide's score per class is one of the first three (``rule``),
and the predicted class is the class with the highest score (single-label), or every class
whose score is at or above ``threshold`` (multi-label).

Metrics (when labels exist): per-class ROC AUC (one class against the rest, from the scores)
with a bootstrap 95% interval, accuracy, balanced accuracy and the confusion matrix. At tile
level the bootstrap resamples slides, not tiles: tiles of one slide are not independent.
"""

from __future__ import annotations

import csv
import io
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import ConfigError
from wsi_loader.files import csv_row

log = logging.getLogger(__name__)

Rule = Literal["mean", "max", "topk"]
RULES: tuple[str, ...] = ("mean", "max", "topk")
BOOTSTRAP_ROUNDS = 1000
TILE_BOOTSTRAP_ROUNDS = 200  # each round scores every tile of the resampled slides
CONFIDENCE = 0.95
# a percentile bootstrap over fewer slides than this has too few distinct resamples to cover
# 95% (3 slides give 10 distinct ones): the interval is shown, with a caveat
RELIABLE_BOOTSTRAP_UNITS = 20


@dataclass(frozen=True)
class SlideRule:
    """How a slide's tiles make its result (see the module's docstring)."""

    rule: str = "mean"
    top_k: int = 10
    threshold: float = 0.5
    multi_label: bool = False

    def check(self) -> None:
        if self.rule not in RULES:
            raise ConfigError(
                f"slide_rule must be one of {RULES}", key="slide_rule", value=self.rule
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ConfigError("top_k must be a whole number >= 1", key="top_k", value=self.top_k)
        if not 0 <= self.threshold <= 1:
            raise ConfigError("threshold must be in [0, 1]", key="threshold", value=self.threshold)

    def deciding(self, classes: int) -> SlideRule:
        """The rule for a model of ``classes`` outputs: a single output (one sigmoid) is
        decided by the threshold, as multi-label classes are (an argmax over one class would
        call every slide and tile that class)."""
        return replace(self, multi_label=True) if classes == 1 else self

    def describe(self) -> str:
        score = {"mean": "mean", "max": "max", "topk": f"mean of the top {self.top_k}"}[self.rule]
        if self.multi_label:
            return f"every class whose {score} tile probability is >= {self.threshold:g}"
        return f"the class with the highest {score} tile probability"


def aggregate(probabilities: npt.NDArray[np.float32], rule: SlideRule) -> dict[str, np.ndarray]:
    """Per class (columns of ``probabilities``, N x C): mean, max, top-k mean, share at or
    above the threshold, and the score the rule picks. NaN for a slide without tiles."""
    n, classes = probabilities.shape
    if n == 0:
        empty = np.full(classes, np.nan)
        return {"mean": empty, "max": empty, "topk": empty, "share": empty, "score": empty}
    p = probabilities.astype(np.float64)
    k = min(rule.top_k, n)
    top = -np.partition(-p, k - 1, axis=0)[:k]  # the k largest per column
    result = {
        "mean": p.mean(axis=0),
        "max": p.max(axis=0),
        "topk": top.mean(axis=0),
        "share": (p >= rule.threshold).mean(axis=0),
    }
    result["score"] = result[rule.rule]
    return result


def predicted(score: np.ndarray, classes: Sequence[str], rule: SlideRule) -> str:
    if np.isnan(score).all():
        return ""
    if rule.multi_label:
        return ";".join(c for c, s in zip(classes, score, strict=True) if s >= rule.threshold)
    return classes[int(np.nanargmax(score))]


def slides_csv(rows: list[dict[str, Any]], classes: Sequence[str], rule: SlideRule) -> bytes:
    """``slides.csv``: slide, name, label, tiles, failed, then per class mean, max, top-k
    mean, share >= threshold and score, then the predicted class."""
    k, t = rule.top_k, f"{rule.threshold:g}"
    per_class = [
        (f"mean_{c}", f"max_{c}", f"top{k}_mean_{c}", f"share_ge_{t}_{c}", f"score_{c}")
        for c in classes
    ]
    header = ["slide", "name", "label", "tiles", "failed", *(n for cols in per_class for n in cols)]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow([*header, "predicted"])
    for row in rows:
        stats = row["stats"]
        numbers = [
            _number(stats[key][i])
            for i in range(len(classes))
            for key in ("mean", "max", "topk", "share", "score")
        ]
        text_cells = csv_row([row["slide"], row["name"], row["label"] or ""])
        writer.writerow(
            [*text_cells, row["tiles"], row["failed"], *numbers, *csv_row([row["predicted"]])]
        )
    return text.getvalue().encode("utf-8")


def _number(value: float) -> str:
    return "" if np.isnan(value) else f"{value:.6g}"


def metrics_available() -> bool:
    """Whether scikit-learn is there (the ``predict`` extra); said once when it is not."""
    try:
        import sklearn.metrics  # noqa: F401
    except ImportError:
        log.warning(
            "slides have labels but scikit-learn is not installed: no metrics.json "
            "(pip install 'wsi_loader[predict]')"
        )
        return False
    return True


def class_of_label(label: str | None, classes: Sequence[str]) -> int | None:
    """The class a label names: exactly, or ignoring case and spacing when that is unique.
    A one-output model (one sigmoid, one class) has no class for its negatives: any other
    label is one (id 1, past the classes), so `normal` slides count against `tumour`."""
    if label is None:
        return None
    if label in classes:
        return list(classes).index(label)
    folded = [i for i, c in enumerate(classes) if c.strip().casefold() == label.strip().casefold()]
    if len(folded) == 1:
        return folded[0]
    return 1 if len(classes) == 1 else None


def metrics(
    labels: npt.NDArray[np.int64],
    scores: npt.NDArray[np.float64],
    classes: Sequence[str],
    rule: SlideRule,
    groups: npt.NDArray[np.int64] | None = None,
    rounds: int = BOOTSTRAP_ROUNDS,
    seed: int = 0,
) -> dict[str, Any]:
    """Metrics of ``scores`` (N x C) against ``labels`` (class ids, N), with scikit-learn.
    ``groups``: what the bootstrap resamples (slide ids of tiles; None: each item).
    What scikit-learn warns of goes to ``notes``."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        result = _metrics(labels, scores, classes, rule, groups, rounds, seed)
    notes = sorted({str(w.message) for w in said})
    if notes:  # e.g. "y_pred contains classes not in y_true" on a handful of slides
        result["notes"] = notes
    return result


def _metrics(
    labels: npt.NDArray[np.int64],
    scores: npt.NDArray[np.float64],
    classes: Sequence[str],
    rule: SlideRule,
    groups: npt.NDArray[np.int64] | None,
    rounds: int,
    seed: int,
) -> dict[str, Any]:
    from sklearn.metrics import (
        accuracy_score,
        balanced_accuracy_score,
        confusion_matrix,
        roc_auc_score,
    )

    n_classes = len(classes)
    result: dict[str, Any] = {"n": len(labels), "classes": list(classes)}
    counts = np.bincount(labels, minlength=n_classes)
    result["support"] = {c: int(counts[i]) for i, c in enumerate(classes)}
    aucs: dict[str, Any] = {}
    for i, name in enumerate(classes):
        truth = labels == i
        if truth.all() or not truth.any():
            aucs[name] = {"auc": None, "why": "needs items of this class and of others"}
            continue
        point = float(roc_auc_score(truth, scores[:, i]))
        # the same resamples for every class (one seed): a two-class problem's intervals
        # mirror each other, and a class's interval is not lost where another's is kept
        low, high, used = _bootstrap(truth, scores[:, i], groups, rounds, seed)
        aucs[name] = {"auc": point, "ci95": [low, high], "bootstrap_rounds": used}
        if low is None:
            aucs[name]["why"] = (
                f"{used} of {rounds} resamples hold both this class and others: too few "
                "for an interval"
            )
    result["roc_auc"] = aucs
    # what the bootstrap resamples: slides (the items, or the slides the tiles come from)
    units = len(labels) if groups is None else len(np.unique(groups))
    result["bootstrap"] = {"slides": units, "reliable": units >= RELIABLE_BOOTSTRAP_UNITS}
    if rule.multi_label:
        decided = scores >= rule.threshold
        result["per_class_accuracy"] = {
            c: float(accuracy_score(labels == i, decided[:, i])) for i, c in enumerate(classes)
        }
        result["per_class_balanced_accuracy"] = {
            c: float(balanced_accuracy_score(labels == i, decided[:, i]))
            for i, c in enumerate(classes)
            if 0 < (labels == i).sum() < len(labels)
        }
        return result
    guess = np.argmax(scores, axis=1)
    result["accuracy"] = float(accuracy_score(labels, guess))
    result["balanced_accuracy"] = float(balanced_accuracy_score(labels, guess))
    matrix = confusion_matrix(labels, guess, labels=list(range(n_classes)))
    result["confusion_matrix"] = {
        "rows": "label",
        "columns": "predicted",
        "classes": list(classes),
        "counts": matrix.tolist(),
    }
    return result


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given their average rank: scipy's ``rankdata(method="average")``
    without importing ``scipy.stats``, which took ~0.5-2 s of every ``predict``'s start-up."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)
    return ((last - counts + 1 + last) / 2)[inverse.reshape(-1)]


def rank_auc(truth: np.ndarray, score: np.ndarray) -> float:
    """ROC AUC as the Mann-Whitney statistic (ties count half): the value scikit-learn's
    roc_auc_score gives, without its input checks, which would dominate a 1,000-round
    bootstrap."""
    ranks = average_ranks(score)
    positives = int(truth.sum())
    negatives = len(truth) - positives
    return float((ranks[truth].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def _bootstrap(
    truth: np.ndarray,
    score: np.ndarray,
    groups: np.ndarray | None,
    rounds: int,
    seed: int,
) -> tuple[float | None, float | None, int]:
    """The percentile interval of the ROC AUC over ``rounds`` resamples (of items, or of
    whole groups), leaving out resamples with a single class; None when too few remain."""
    rng = np.random.default_rng(seed)
    if groups is None:
        members = [np.array([i]) for i in range(len(truth))]
    else:
        order = np.argsort(groups, kind="stable")
        cuts = np.flatnonzero(np.diff(groups[order])) + 1
        members = np.split(order, cuts)
    values = []
    for _ in range(rounds):
        picked = rng.integers(0, len(members), size=len(members))
        rows = np.concatenate([members[i] for i in picked])
        sample = truth[rows]
        if sample.all() or not sample.any():
            continue
        values.append(rank_auc(sample, score[rows]))
    if len(values) < rounds // 2:
        return None, None, len(values)
    alpha = (1 - CONFIDENCE) / 2
    low, high = np.quantile(values, [alpha, 1 - alpha])
    return float(low), float(high), len(values)


def table(result: dict[str, Any], title: str) -> str:
    """A few lines for the terminal: AUC [interval] per class, accuracies, confusion matrix."""
    lines = [f"{title} (n={result['n']})"]
    shown = False
    for name, auc in result["roc_auc"].items():
        if auc["auc"] is None:
            lines.append(f"  ROC AUC {name}: - ({auc['why']})")
        else:
            low, high = auc["ci95"]
            interval = f"[{low:.3f}, {high:.3f}]" if low is not None else f"[-: {auc['why']}]"
            lines.append(f"  ROC AUC {name}: {auc['auc']:.3f} {interval}")
            shown = shown or low is not None
    bootstrap = result.get("bootstrap")  # (absent from metrics of older runs)
    if shown and bootstrap and not bootstrap["reliable"]:
        lines.append(
            f"  n={bootstrap['slides']} slides: interval unreliable (fewer than "
            f"{RELIABLE_BOOTSTRAP_UNITS} slides to resample)"
        )
    if "accuracy" in result:
        lines.append(
            f"  accuracy {result['accuracy']:.3f}, balanced accuracy "
            f"{result['balanced_accuracy']:.3f}"
        )
        matrix = result["confusion_matrix"]
        width = max(len(c) for c in matrix["classes"]) + 2
        lines.append("  confusion (rows: label, columns: predicted)")
        lines.append(" " * (width + 2) + "".join(f"{c:>{width}}" for c in matrix["classes"]))
        for name, counts in zip(matrix["classes"], matrix["counts"], strict=True):
            lines.append(f"  {name:>{width}}" + "".join(f"{v:>{width}}" for v in counts))
    return "\n".join(lines)
