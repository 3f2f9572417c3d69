"""Label names: their id order (`label_order`), and warnings about labels that are probably
mistakes (one class spelt two ways, a spelt-out missing value, a split without a class).
Splits and patients: a slide's patient (given, or from a TCGA barcode), a patient in two
splits refused, and the slides a split name selects (``fold2:train`` of k folds).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from wsi_loader.errors import InputError
from wsi_loader.index._inputs import slide_name
from wsi_loader.index._table_files import SlideRecord

if TYPE_CHECKING:  # _table selects splits with the functions below
    from wsi_loader.index._table import SlideIndex

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def similar_labels(labels: Iterable[str]) -> list[list[str]]:
    """Groups of distinct labels that differ only in case, spacing, '_' or '-' ('Tumor' /
    'tumor', 'high grade' / 'high_grade'): two classes, where one was almost surely meant."""
    groups: dict[str, set[str]] = {}
    for name in labels:
        groups.setdefault(re.sub(r"[\s_-]+", " ", name.casefold()).strip(), set()).add(name)
    return sorted(sorted(group) for group in groups.values() if len(group) > 1)


def warn_similar(names: Iterable[str], what: str) -> None:
    """Say which labels differ only in case or spacing: kept apart, they are separate classes."""
    groups = similar_labels(names)
    if groups:
        shown = "; ".join(" / ".join(repr(n) for n in group) for group in groups[:5])
        log.warning(
            "%s that differ only in case or spacing: %s. They are separate classes; spell "
            "each one way if one class is meant",
            what,
            shown,
        )


# how pandas (astype(str)), R, Excel and SQL exports write a missing value
MISSING_SPELLINGS = frozenset({"nan", "na", "n/a", "#n/a", "<na>", "none", "null", "nat"})


def warn_missing_spelt(labels: list[str]) -> None:
    """Say which labels spell a missing value ('nan', 'NA'...): each is a class of its own,
    which a model then learns as if it were a diagnosis. Kept: the user decides."""
    counts = Counter(label for label in labels if label.strip().casefold() in MISSING_SPELLINGS)
    if counts:
        shown = ", ".join(
            f"{label!r} ({n} slide{'s' * (n != 1)})" for label, n in sorted(counts.items())
        )
        log.warning(
            "labels that look like a missing value written by pandas, R or a spreadsheet: %s. "
            "They are classes of their own; leave slides without a label out of the labels "
            "file",
            shown,
        )


def warn_split_gaps(index: SlideIndex) -> None:
    """Say which split lacks a label another split has: its metrics cannot measure that
    class (a validation split without a single tumour slide)."""
    splits = index.splits()
    if len(splits) < 2:
        return
    counts = {split: index.label_counts(split) for split in splits}
    unit = "tile" if index.labels_from_annotations else "slide"
    gaps = []
    for split in splits:
        for name in index.label_names:
            others = [
                f"{other} has {counts[other][name][unit + 's']}"
                for other in splits
                if other != split and name in counts[other]
            ]
            if name not in counts[split] and others:
                gaps.append(
                    f"split {split!r} has no {unit} labelled {name!r} ({', '.join(others)})"
                )
    if gaps:
        more = f"; and {len(gaps) - 10} more" if len(gaps) > 10 else ""
        log.warning(
            "%s%s: metrics on such a split cannot measure that class",
            "; ".join(gaps[:10]),
            more,
        )


def label_order(labels: Iterable[str]) -> list[str]:
    """Label names in id order: by value when every label is a number (grades, class numbers:
    '2' before '10'), else as text. Ties ('1', '01') are broken by the text."""
    names = set(labels)
    if names and all(_NUMBER.fullmatch(name) for name in names):
        return sorted(names, key=lambda name: (float(name), name))
    return sorted(names)


# a TCGA barcode: project, tissue source site and participant make the case
# (TCGA-CR-7395-01A-01-TS1 and TCGA-CR-7395-01Z-00-DX1 are slides of case TCGA-CR-7395)
_TCGA_CASE = re.compile(r"(TCGA-[A-Z0-9]{2}-[A-Z0-9]{4})(?:-|$)", re.IGNORECASE)


def tcga_case(name: str) -> str | None:
    """The case (patient) of a slide named by a TCGA barcode, else None."""
    match = _TCGA_CASE.match(name)
    return match.group(1).upper() if match else None


def patient_of(record: SlideRecord) -> str | None:
    """A slide's patient: the ``patient`` (or ``case_id``) given for it, else the case of its
    TCGA barcode name, else None (unknown: the slide is its own group)."""
    return record.patient or tcga_case(slide_name(record.path))


def check_patient_splits(records: Sequence[SlideRecord]) -> None:
    """A patient's slides are in one split: two slides of one patient in two splits leak
    the patient's tissue, as one slide in two splits would (an `InputError`)."""
    seen: dict[str, SlideRecord] = {}
    for record in records:
        patient = patient_of(record) if record.split is not None else None
        if patient is None:
            continue
        other = seen.setdefault(patient, record)
        if other.split != record.split:
            raise InputError(
                f"patient {patient!r} is in two splits: {other.path} ({other.split!r}) and "
                f"{record.path} ({record.split!r}); give a patient's slides one split "
                "(wsi-loader split assigns whole patients)"
            )


_FOLD = re.compile(r"fold\d+")
_FOLD_PART = re.compile(r"(fold\d+):(train|val|test)")


def split_members(slides: Sequence[SlideRecord], split: str) -> list[bool] | None:
    """Which slides ``split`` selects: those of that split name, or, for folds written by
    `wsi-loader split --folds K` (slides in ``fold1`` .. ``foldK`` and ``test``),
    ``foldN:val`` (fold N), ``foldN:train`` (the other folds) and ``foldN:test``. None when
    the name selects nothing the index has."""
    names = {s.split for s in slides if s.split is not None}
    if split in names:
        return [s.split == split for s in slides]
    match = _FOLD_PART.fullmatch(split)
    if match is None or match.group(1) not in names:
        return None
    fold, part = match.groups()
    if part == "val":
        return [s.split == fold for s in slides]
    if part == "test":
        return [s.split == "test" for s in slides]
    return [
        s.split is not None and bool(_FOLD.fullmatch(s.split)) and s.split != fold for s in slides
    ]


def split_mask(slides: Sequence[SlideRecord], split: str | None) -> list[bool]:
    """Which slides are in ``split`` (all of them for None; a name the index lacks: none)."""
    if split is None:
        return [True] * len(slides)
    return split_members(slides, split) or [False] * len(slides)


def split_choices(names: Sequence[str]) -> str:
    """The split names an index offers, said for an error (folds as ``foldN:train|val``)."""
    folds = [name for name in names if _FOLD.fullmatch(name)]
    if not folds:
        return str(list(names)) if names else "none"
    others = [name for name in names if name not in folds]
    first, last = folds[0], folds[-1]
    return str(
        [
            *others,
            f"{first} .. {last} (each fold: its slides, as foldN:val)",
            f"{first}:train .. {last}:train",
            f"{first}:val .. {last}:val",
            *([f"{first}:test .. {last}:test"] if "test" in others else []),
        ]
    )
