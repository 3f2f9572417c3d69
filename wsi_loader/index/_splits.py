"""Train/validation/test splits made for an index (`wsi-loader split`): whole patients (or
slides) dealt to the splits, stratified by label, the same for the same seed; or k folds
beside a held-out test split. The assignment is written as a new generation whose slide
records carry it, so `SlideIndex.open(split=...)`, the datasets and the exports read it as
they read a manifest's ``split`` column.

Dealing: the groups (patients) are shuffled within each label by the seed, the labels laid
one after another, and the groups dealt in that order by systematic sampling (a test share
of 0.2 takes every fifth group). Each split gets its share of the groups, rounded (0.2 of 12
patients: 2), and each label its share of each split, to one group; k folds are dealt in
turn, so fold sizes differ by one group at most.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from wsi_loader.errors import InputError
from wsi_loader.index._labels import check_patient_splits, patient_of, warn_split_gaps
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import SlideRecord
from wsi_loader.index._table_writer import exclusive_build, split_tiles, write_index

log = logging.getLogger(__name__)

# what write_index records itself; the rest of meta.json is carried over
_WRITTEN_META = frozenset(
    {"schema_version", "generation", "created", "params", "root", "slides_total",
     "tiles_total", "columns"}
)  # fmt: skip


@dataclass(frozen=True)
class SplitPlan:
    """How to split: ``by`` patient or slide; ``stratify`` by label or not; ``folds`` (1: one
    train/val/test split; K > 1: K folds, each the validation set of one round, beside a
    held-out test split); the ``test`` and ``val`` shares (of groups; ``val`` only without
    folds); the ``seed``."""

    by: Literal["patient", "slide"] = "patient"
    stratify: Literal["label"] | None = "label"
    folds: int = 1
    test: float = 0.2
    val: float = 0.2
    seed: int = 0

    def check(self) -> None:
        if self.folds < 1:
            raise ValueError(f"--folds must be 1 or more, got {self.folds}")
        for name, share in (("test", self.test), ("val", self.val)):
            if not 0 <= share < 1:
                raise ValueError(f"--{name} must be a share in [0, 1), got {share:g}")
        if self.folds > 1 and self.val:
            raise ValueError(
                "--val does not apply with --folds: each fold is the validation set of one "
                "round (leave --val out, or give --val 0)"
            )
        if self.folds == 1 and self.test + self.val >= 1:
            raise ValueError(
                f"--test {self.test:g} and --val {self.val:g} leave nothing to train on"
            )

    def as_json(self) -> dict[str, Any]:
        return {
            "by": self.by,
            "stratify": self.stratify,
            "folds": self.folds,
            "test": self.test,
            "val": self.val if self.folds == 1 else None,
            "seed": self.seed,
        }


def _dealt(count: int, share: float) -> list[bool]:
    """Systematic sampling: which of ``count`` items in order fall to a ``share`` (as many as
    ``count * share`` rounded, spread evenly)."""
    return [math.floor((i + 1) * share + 0.5) > math.floor(i * share + 0.5) for i in range(count)]


def _group(record: SlideRecord, by: str) -> str:
    if by == "patient":
        patient = patient_of(record)
        if patient is not None:
            return f"patient {patient}"
    return f"slide {record.path}"


def assign(slides: Sequence[SlideRecord], plan: SplitPlan) -> list[str | None]:
    """Each slide's split under ``plan`` (None for slides that failed to index). Raises
    `InputError` when the plan cannot be met (a label missing, more folds than groups)."""
    plan.check()
    usable = [i for i, s in enumerate(slides) if s.status == "ok"]
    if not usable:
        raise InputError("the index has no indexed slide to split")
    if plan.stratify == "label":
        missing = [slides[i].path for i in usable if slides[i].label is None]
        if missing:
            first = ", ".join(os.path.basename(p) for p in missing[:5])
            raise InputError(
                f"--stratify label: {len(missing)} slides have no label ({first}"
                f"{', ...' if len(missing) > 5 else ''}); label them (index --labels) or "
                "split without --stratify"
            )
    members: dict[str, list[int]] = {}
    for i in usable:
        members.setdefault(_group(slides[i], plan.by), []).append(i)
    strata: dict[str, list[str]] = {}
    for group, rows in sorted(members.items()):
        labels = Counter(slides[i].label or "" for i in rows)
        # a patient whose slides carry several labels is stratified by the most common one
        label = min(labels, key=lambda name: (-labels[name], name)) if plan.stratify else ""
        strata.setdefault(label, []).append(group)
    rng = np.random.default_rng(plan.seed)
    ordered = [
        stratum[k] for _, stratum in sorted(strata.items()) for k in rng.permutation(len(stratum))
    ]
    held = _dealt(len(ordered), plan.test)
    rest = [group for group, out in zip(ordered, held, strict=True) if not out]
    unit = "patients" if plan.by == "patient" else "slides"
    split_of = {group: "test" for group, out in zip(ordered, held, strict=True) if out}
    if plan.folds > 1:
        if len(rest) < plan.folds:
            raise InputError(
                f"--folds {plan.folds} needs at least {plan.folds} {unit} outside the test "
                f"split; there are {len(rest)} (of {len(ordered)})"
            )
        offset = int(rng.integers(plan.folds))
        split_of |= {g: f"fold{(j + offset) % plan.folds + 1}" for j, g in enumerate(rest)}
    else:
        in_val = _dealt(len(rest), plan.val / (1 - plan.test))
        split_of |= {g: "val" if v else "train" for g, v in zip(rest, in_val, strict=True)}
        if not any(v == "train" for v in split_of.values()):
            raise InputError(f"no {unit[:-1]} is left to train on: {len(ordered)} {unit} in all")
    out: list[str | None] = [None] * len(slides)
    for group, rows in members.items():
        for i in rows:
            out[i] = split_of[group]
    return out


def write_splits(path: str | os.PathLike[str], plan: SplitPlan, overwrite: bool) -> SlideIndex:
    """Split the index at ``path`` under ``plan`` and write it as a new generation (the
    tiles as they are). An index that has splits already is refused unless ``overwrite``."""
    with exclusive_build(path):
        index = SlideIndex.open(path)
        if index.splits() and not overwrite:
            raise InputError(
                f"the index has splits already ({', '.join(index.splits())}); pass "
                "--overwrite (overwrite=True) to replace them",
                path=os.fspath(path),
            )
        splits = assign(index.slides, plan)
        records = [
            replace(record, split=split) for record, split in zip(index.slides, splits, strict=True)
        ]
        try:
            check_patient_splits(records)
        except InputError as exc:  # --by slide, on slides whose patients are known
            raise InputError(f"{exc}; or split with --by patient") from None
        tiles = [split_tiles(index, i) for i in range(len(records))]
        extra = {k: v for k, v in index.meta.items() if k not in _WRITTEN_META}
        extra["splits"] = plan.as_json()
        params, root = index.params, index.meta.get("root")
        del index  # releases its generation, which write_index may then delete
        written = write_index(path, records, tiles, params, root, extra)
    warn_split_gaps(written)
    return written
