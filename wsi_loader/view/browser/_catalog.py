"""The slides a viewer serves: the index's slides, found by id only, each with the version of
its file that is there now (part of every cache key and ETag) and what is wrong with it.

A slide is checked (one ``stat``) when the page opens it: missing, or replaced since indexing
(another size or mtime and other contents: a ``touch`` or a copy is not a replacement) is said
in the page; its tiles are then grey, or from the file that is there, with the banner saying
the grid may not match. Objects (URLs) are checked with one metadata request.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import threading
from dataclasses import dataclass
from typing import Any

from wsi_loader.index._fingerprints import content_key
from wsi_loader.index._health import slide_problem
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import SlideRecord
from wsi_loader.slides.storage._sources import is_url
from wsi_loader.view.browser._public import scrub
from wsi_loader.view.browser._tiles import SlideRef

MISSING = "missing"  # the version of a slide file that is not there


@dataclass(frozen=True)
class SlideState:
    """A slide's file as found: its version and, when something is wrong, what."""

    version: str
    problem: str | None = None
    identity: tuple[int, int, int, int] | None = None  # (device, inode, size, mtime) checked


def display_name(path: str) -> str:
    """The file name of a stored path (an object's last key part for a URL)."""
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(path)


class Catalog:
    """The index's slides and their states (thread-safe)."""

    def __init__(self, index: SlideIndex) -> None:
        self.index = index
        self._states: dict[int, SlideState] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index.slides)

    def record(self, slide_id: int) -> SlideRecord:
        return self.index.slides[slide_id]

    def has(self, slide_id: int) -> bool:
        return 0 <= slide_id < len(self.index.slides)

    def state(self, slide_id: int, fresh: bool = False) -> SlideState:
        """The slide's state, checked again when ``fresh`` (or never checked yet)."""
        with self._lock:
            known = self._states.get(slide_id)
        if known is not None and not fresh:
            return known
        found = self._check(slide_id, known)
        with self._lock:
            self._states[slide_id] = found
        return found

    def _check(self, slide_id: int, known: SlideState | None) -> SlideState:
        record = self.index.slides[slide_id]
        path = self.index.slide_path(slide_id)
        if is_url(path):
            problem = scrub(slide_problem(self.index, slide_id))
            version = record.fingerprint or _digest(path)
            return SlideState(MISSING if problem == "does not exist" else version, problem)
        try:
            st = os.stat(path)
        except OSError as exc:
            reason = "does not exist" if isinstance(exc, FileNotFoundError) else exc.strerror
            return SlideState(MISSING, f"the slide file {reason}")
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if known is not None and known.identity == identity:
            return known  # nothing changed since the last check
        version = _digest(f"{record.fingerprint}:{identity}")
        if (st.st_size, st.st_mtime_ns) == (record.size, record.mtime_ns) or not record.content:
            return SlideState(version, None, identity)
        try:
            same = content_key(path, like=record.content) == record.content
        except OSError as exc:  # the path stays out: the page gets this text
            return SlideState(version, f"the slide file cannot be read ({exc.strerror})", identity)
        if same:
            return SlideState(version, None, identity)
        problem = (
            "the slide file was replaced since indexing (other contents): its pixels are shown, "
            "but the grid and overlays are of the file indexed; rebuild the index"
        )
        return SlideState(version, problem, identity)

    def ref(self, slide_id: int) -> SlideRef:
        """What the tile maker needs of the slide (its state checked once: may touch the
        file, or the store, the first time)."""
        return self._ref(slide_id, self.state(slide_id))

    def known_ref(self, slide_id: int) -> SlideRef | None:
        """`ref` when the slide's state is known already (no I/O), else None."""
        with self._lock:
            known = self._states.get(slide_id)
        return None if known is None else self._ref(slide_id, known)

    def _ref(self, slide_id: int, state: SlideState) -> SlideRef:
        record = self.index.slides[slide_id]
        path = self.index.slide_path(slide_id)
        return SlideRef(slide_id, path, state.version, record.width or 0, record.height or 0)

    def summary(self) -> list[dict[str, Any]]:
        """One entry per slide for the page's list (no file is touched; no path: the page
        names slides by id and file name)."""
        return [
            {
                "id": sid,
                "name": display_name(record.path),
                "label": record.label,
                "split": record.split,
                "status": record.status,
                "error": scrub(record.error),
                "tiles": record.tiles,
                "width": record.width,
                "height": record.height,
            }
            for sid, record in enumerate(self.index.slides)
        ]


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
