"""Label names: their id order (`label_order`), and warnings about labels that are probably
mistakes (one class spelt two ways, a spelt-out missing value, a split without a class).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable

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
