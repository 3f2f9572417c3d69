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

Slides with no tiles (smaller than one tile, no tissue) are left out of the dealing: they get
no split (a split of such slides alone would hold no tile), and a warning names them.
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
from wsi_loader.index._fingerprints import ends_digest
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


def dealt(record: SlideRecord) -> bool:
    """Whether a slide is dealt to a split: indexed, with tiles."""
    return record.status == "ok" and record.tiles > 0


def no_tiles(slides: Sequence[SlideRecord]) -> list[str]:
    """The paths of the indexed slides with no tiles and no split (left out of the dealing)."""
    return [s.path for s in slides if s.status == "ok" and s.tiles == 0 and s.split is None]


def _group(record: SlideRecord, by: str) -> str:
    if by == "patient":
        patient = patient_of(record)
        if patient is not None:
            return f"patient {patient}"
    return f"slide {record.path}"


def _check_labelled(slides: Sequence[SlideRecord], rows: list[int], plan: SplitPlan) -> None:
    if plan.stratify == "label":
        missing = [slides[i].path for i in rows if slides[i].label is None]
        if missing:
            first = ", ".join(os.path.basename(p) for p in missing[:5])
            raise InputError(
                f"--stratify label: {len(missing)} slides have no label ({first}"
                f"{', ...' if len(missing) > 5 else ''}); label them (index --labels) or "
                "split without --stratify"
            )


def _members(
    slides: Sequence[SlideRecord], rows: list[int], plan: SplitPlan
) -> dict[str, list[int]]:
    """The slides (their positions) of each group dealt whole. Copies of one scan (a symlink,
    a second download: the same contents) join one group, whatever their names say: the
    index refuses one scan in two splits."""
    parent: dict[str, str] = {}

    def root(group: str) -> str:
        while parent.setdefault(group, group) != group:
            group = parent[group]
        return group

    group_of_scan: dict[str, str] = {}
    for i in rows:
        group = root(_group(slides[i], plan.by))
        content = slides[i].content
        if content is not None:
            other = root(group_of_scan.setdefault(ends_digest(content), group))
            if other != group:  # the smaller name stands for both, whatever the order
                parent[max(other, group)] = min(other, group)
    members: dict[str, list[int]] = {}
    for i in rows:
        members.setdefault(root(_group(slides[i], plan.by)), []).append(i)
    return members


def patients(slides: Sequence[SlideRecord]) -> list[str | None]:
    """Each slide's patient as `split` deals them (its patient, else the slide itself; copies
    of one scan joined), for the slides that have a split; None for the others."""
    rows = [i for i, s in enumerate(slides) if s.split is not None]
    out: list[str | None] = [None] * len(slides)
    for group, members in _members(slides, rows, SplitPlan()).items():
        for i in members:
            out[i] = group
    return out


def _stratum(slides: Sequence[SlideRecord], rows: list[int], plan: SplitPlan) -> str:
    """A group's label (a patient whose slides carry several: the most common one)."""
    if not plan.stratify:
        return ""
    labels = Counter(slides[i].label or "" for i in rows)
    return min(labels, key=lambda name: (-labels[name], name))


def assign(slides: Sequence[SlideRecord], plan: SplitPlan) -> list[str | None]:
    """Each slide's split under ``plan`` (None for slides that failed to index or have no
    tiles). Raises `InputError` when the plan cannot be met (a label missing, more folds than
    groups)."""
    plan.check()
    usable = [i for i, s in enumerate(slides) if dealt(s)]
    if not usable:
        raise InputError("the index has no indexed slide with tiles to split")
    _check_labelled(slides, usable, plan)
    members = _members(slides, usable, plan)
    strata: dict[str, list[str]] = {}
    for group, rows in sorted(members.items()):
        strata.setdefault(_stratum(slides, rows, plan), []).append(group)
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


def _shares(plan: SplitPlan) -> dict[str, float]:
    """Each split of ``plan`` and its share of the groups (splits of no share left out)."""
    if plan.folds > 1:
        shares = {f"fold{k}": (1 - plan.test) / plan.folds for k in range(1, plan.folds + 1)}
    else:
        shares = {"train": 1 - plan.test - plan.val, "val": plan.val}
    return {name: share for name, share in {**shares, "test": plan.test}.items() if share > 0}


def assign_more(slides: Sequence[SlideRecord], plan: SplitPlan) -> list[str | None]:
    """Each slide's split, the slides that have one keeping it: a slide of a group (patient)
    that has a split joins it, and the groups without one are dealt under ``plan``, stratum
    by stratum in the seed's order, each to the split furthest below its share of the
    stratum. Raises `InputError` when the splits there are not those of ``plan``."""
    plan.check()
    shares = _shares(plan)
    out = [s.split for s in slides]
    foreign = sorted({name for name in out if name is not None} - set(shares))
    if foreign:
        raise InputError(
            f"the index has splits ({', '.join(foreign)}) that {_described(plan)} does not "
            "deal: give the options the index was split with, or pass --overwrite "
            "(overwrite=True) to deal every patient again"
        )
    usable = [i for i, s in enumerate(slides) if dealt(s)]
    members = _members(slides, usable, plan)
    has = {g: sorted({out[i] or "" for i in rows} - {""}) for g, rows in members.items()}
    new = [g for g in sorted(members) if not has[g]]
    _check_labelled(slides, [i for g in new for i in members[g]], plan)
    counts: dict[str, Counter[str]] = {}
    strata: dict[str, list[str]] = {}
    for group, rows in sorted(members.items()):
        stratum = _stratum(slides, rows, plan)
        counts.setdefault(stratum, Counter())
        if has[group]:
            counts[stratum][has[group][0]] += 1
        else:
            strata.setdefault(stratum, []).append(group)
    rng = np.random.default_rng(plan.seed)
    names = list(shares)
    split_of = {g: split[0] for g, split in has.items() if split}
    for stratum, groups in sorted(strata.items()):
        count = counts[stratum]
        for k in rng.permutation(len(groups)):
            total = sum(count.values()) + 1
            # ties go to the first in a rotating order, so folds are filled in turn
            start = int(rng.integers(len(names)))
            order = names[start:] + names[:start]
            best = max(order, key=lambda n: shares[n] * total - count[n])
            split_of[groups[k]] = best
            count[best] += 1
    for group, rows in members.items():
        for i in rows:
            if out[i] is None:
                out[i] = split_of[group]
    return out


def _described(plan: SplitPlan) -> str:
    if plan.folds > 1:
        return f"--folds {plan.folds} --test {plan.test:g}"
    return f"--test {plan.test:g} --val {plan.val:g}"


def stored_plan(index: SlideIndex) -> SplitPlan | None:
    """The plan `write_splits` recorded in the index, if any."""
    stored = index.meta.get("splits")
    if not isinstance(stored, dict):
        return None
    return SplitPlan(
        by=stored.get("by", "patient"),
        stratify=stored.get("stratify"),
        folds=int(stored.get("folds", 1)),
        test=float(stored.get("test", 0.2)),
        val=float(stored.get("val") or 0.0),
        seed=int(stored.get("seed", 0)),
    )


def _unchanged(given: SplitPlan, stored: SplitPlan) -> bool:
    """Whether ``given`` deals as ``stored`` did (the seed aside: it orders new groups)."""
    return replace(given, seed=stored.seed) == stored


def write_splits(
    path: str | os.PathLike[str], plan: SplitPlan | None, overwrite: bool
) -> SlideIndex:
    """Split the index at ``path`` under ``plan`` and write it as a new generation (the
    tiles as they are). Slides with no tiles get no split (a warning names them).

    An index that has splits already keeps them unless ``overwrite``: its slides without a
    split (slides added since) are dealt, those of a patient with a split to that split, the
    new patients under the plan the index was split with (``plan`` None, or the same plan);
    with nothing to deal the index is returned as it is. ``plan`` None on an index without
    splits: one train/val/test split, not stratified."""
    with exclusive_build(path):
        index = SlideIndex.open(path)
        stored = stored_plan(index)
        if index.splits() and not overwrite:
            if plan is not None and stored is not None and not _unchanged(plan, stored):
                raise InputError(
                    f"the index was split with {_described(stored)} (by {stored.by}, "
                    f"stratify {stored.stratify or 'none'}), not {_described(plan)} (by "
                    f"{plan.by}, stratify {plan.stratify or 'none'}): leave the options out "
                    "to deal its unassigned patients as its splits were dealt, or pass "
                    "--overwrite (overwrite=True) to deal every patient again",
                    path=os.fspath(path),
                )
            plan = plan or stored or _inferred_plan(index.splits())
            if all(s.split is not None for s in index.slides if dealt(s)):
                log.info("every indexed slide with tiles has a split: nothing to assign")
                _warn_no_tiles(index.slides)
                return index
            splits = assign_more(index.slides, plan)
        else:
            plan = plan or SplitPlan(stratify=None)
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
        extra["splits"] = (stored if stored and not overwrite else plan).as_json()
        params, root = index.params, index.meta.get("root")
        del index  # releases its generation, which write_index may then delete
        written = write_index(path, records, tiles, params, root, extra)
    _warn_no_tiles(written.slides)
    warn_split_gaps(written)
    return written


def _warn_no_tiles(slides: Sequence[SlideRecord]) -> None:
    left = no_tiles(slides)
    if left:
        more = f", and {len(left) - 10} more" if len(left) > 10 else ""
        log.warning(
            "%d slides have no tiles and were left out of the dealing (no split): %s%s",
            len(left),
            ", ".join(left[:10]),
            more,
        )


def _inferred_plan(names: list[str]) -> SplitPlan:
    """The plan of splits an index's inputs gave (fold1..foldK and test, or train/val/test),
    not stratified, of the default shares."""
    folds = [int(n[4:]) for n in names if n.startswith("fold") and n[4:].isdigit()]
    if folds:
        return SplitPlan(stratify=None, folds=max(folds), val=0.0)
    return SplitPlan(stratify=None)
