"""Slide faults found before reading: is every slide of an index still there?

A missing or unreadable slide is one *slide* fault, never thousands of tile faults: datasets,
loaders and exports call `require_slides` when they start (one ``stat`` per slide), and either
fail naming the missing slides and the root to fix, or leave those slides out with a warning.
Remote slides (URLs) are checked with one metadata request each, run concurrently: a missing
object, a refused credential or an unreachable store is said here, before any tile is read.
"""

from __future__ import annotations

import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from wsi_loader.errors import SlideChangedError, SlideError, SlideNotFoundError
from wsi_loader.index._table import SlideIndex
from wsi_loader.slides.storage._sources import is_url, remote_stat

log = logging.getLogger(__name__)

OnMissing = Literal["raise", "exclude"]
ON_MISSING: tuple[str, ...] = ("raise", "exclude")
SHOWN = 5  # missing slides named in messages
CHANGED = "changed since indexing"
DOES_NOT_EXIST = "does not exist"


def slide_problem(index: SlideIndex, slide_id: int) -> str | None:
    """Why slide ``slide_id`` cannot be read as indexed, or None when it looks fine."""
    path = index.slide_path(slide_id)
    record = index.slides[slide_id]
    if is_url(path):
        return _object_problem(path, record.size)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return DOES_NOT_EXIST
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if not os.access(path, os.R_OK):
        return "cannot be read (permission denied)"
    series = path.lower().endswith((".dcm", ".dicom"))  # the recorded size is the series'
    if record.size is not None and not series and st.st_size != record.size:
        return f"{CHANGED} ({st.st_size} bytes, indexed {record.size})"
    return None


def _object_problem(url: str, size: int | None) -> str | None:
    try:
        stat = remote_stat(url)
    except SlideNotFoundError:
        return DOES_NOT_EXIST
    except SlideError as exc:
        reason = str(exc)
        return f"cannot be reached ({reason.removeprefix(url + ': ')})"
    if size is not None and stat.size != size:
        return f"{CHANGED} ({stat.size} bytes, indexed {size})"
    return None


def slides_in_use(index: SlideIndex) -> list[int]:
    """Ids of the slides that have rows in ``index`` (a view may hold fewer)."""
    starts = index.slide_starts()
    return [sid for sid in range(len(index.slides)) if starts[sid + 1] > starts[sid]]


def slide_problems(index: SlideIndex, slide_ids: list[int]) -> dict[int, str]:
    """`slide_problem` of each slide of ``slide_ids`` that has one (remote slides checked
    concurrently: one round trip each)."""
    remote = [sid for sid in slide_ids if is_url(index.slide_path(sid))]
    found: dict[int, str | None] = {}
    if remote:
        with ThreadPoolExecutor(min(32, len(remote)), thread_name_prefix="wsi-stat") as pool:
            found = dict(
                zip(remote, pool.map(lambda s: slide_problem(index, s), remote), strict=True)
            )
    problems = {}
    for sid in slide_ids:
        problem = found[sid] if sid in found else slide_problem(index, sid)
        if problem is not None:
            problems[sid] = problem
    return problems


def is_change(problem: str) -> bool:
    """Whether a `slide_problem` is a slide changed since indexing (not a missing one)."""
    return problem.startswith(CHANGED)


def problem_kind(problem: str) -> str:
    """A `slide_problem` in one word: "missing", "changed" or "unreadable"."""
    if problem == DOES_NOT_EXIST:
        return "missing"
    return "changed" if is_change(problem) else "unreadable"


def require_slides(index: SlideIndex, on_missing: str = "raise") -> SlideIndex:
    """Check that every slide with rows in ``index`` can be read; raise `SlideNotFoundError`
    (``on_missing="raise"``; `SlideChangedError` when every one that cannot is there but
    changed since indexing) or return a view without those slides, with a WARNING listing
    them (``"exclude"``)."""
    if on_missing not in ON_MISSING:
        raise ValueError(f"missing_slides must be one of {ON_MISSING}, got {on_missing!r}")
    problems = slide_problems(index, slides_in_use(index))
    if not problems:
        return index
    shown = "; ".join(
        f"{index.slide_path(sid)} {why}" for sid, why in list(problems.items())[:SHOWN]
    )
    more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
    if on_missing == "exclude":
        log.warning(
            "leaving out %d of %d slides of %s that cannot be read: %s%s",
            len(problems),
            len(index.slides),
            index.path,
            shown,
            more,
        )
        return index.view(drop_slides=problems)
    what = (
        f"{len(problems)} of {len(index.slides)} slides of the index {index.path} cannot be "
        f"read: {shown}{more}."
    )
    exclude = "or leave these slides out with missing_slides='exclude' (--missing-slides exclude)"
    rebuild = (
        "rebuild the index (the same 'wsi-loader index' command or build_index call: "
        "unchanged slides are carried over)"
    )
    missing = [sid for sid, why in problems.items() if not is_change(why)]
    if not missing:  # the files are there: they are not the slides that were indexed
        raise SlideChangedError(
            f"{what} The index describes the slides as they were: {rebuild}, {exclude}",
            path=index.slide_path(next(iter(problems))),
        )
    changed = (
        f" For slides that changed since indexing, {rebuild}."
        if len(missing) < len(problems)
        else ""
    )
    where = _where(index, missing[0])
    stored = index.slides[missing[0]].path
    if os.path.isabs(stored) and not is_url(stored):  # a root cannot remap it (refused)
        moved = "if the archive moved, rebuild the index where the slides are now"
    else:
        moved = (
            "if the archive moved, give its folder as the root "
            "(SlideIndex.open(dir, root=...) or --root)"
        )
    raise SlideNotFoundError(
        f"{what} {where[0].upper()}{where[1:]}; {moved}, {exclude}.{changed}",
        path=index.slide_path(missing[0]),
    )


def _where(index: SlideIndex, slide_id: int) -> str:
    """Where the index looks for its slides, for a message about missing ones."""
    stored = index.slides[slide_id].path
    if is_url(stored) or (index.root is not None and is_url(index.root)):
        return (
            "the slides are objects in a store: check that they are there, and the storage "
            "client's endpoint and credentials (e.g. AWS_ENDPOINT_URL, AWS_PROFILE)"
        )
    if os.path.isabs(stored):
        return "the index stores absolute slide paths (build it with --root to make it movable)"
    return f"slide paths are relative to the root {index.root!r}"
