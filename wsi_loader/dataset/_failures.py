"""What a read reports: `ReadResult` (the pixels and what happened to each tile), and
`TileReader`'s failure records: the failures kept in memory, one WARNING per slide per process,
the tile and slide records appended to the index's quarantine."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import SlideError, TileReadError, TransientReadError
from wsi_loader.index._quarantine import Quarantine
from wsi_loader.index._table import SlideIndex

log = logging.getLogger(__name__)

FAILURES_KEPT = 1000  # failures kept in TileReader.failures (all are counted)


@dataclass
class ReadResult:
    """Pixels of a group of rows plus what happened to each (all arrays have one row per tile)."""

    pixels: npt.NDArray[np.uint8]  # (N, H, W, 3)
    ok: npt.NDArray[np.bool_]
    substituted: npt.NDArray[np.bool_]
    source_rows: npt.NDArray[np.int64]  # the row whose pixels were returned
    errors: list[str | None] = field(default_factory=list)
    encoded: list[bytes | None] | None = None  # compressed tiles left for the caller to decode
    # one (N, size, size, 3) buffer per context scale, and per tile and scale the box of the
    # context tile that is on the slide (N, scales, 4: x0, y0, x1, y1; see dataset._context)
    context: list[npt.NDArray[np.uint8]] = field(default_factory=list)
    context_inside: npt.NDArray[np.int32] | None = None


class FailureRecords:
    """Failure bookkeeping of `TileReader` (its base class; the state is set by
    `TileReader.__init__`)."""

    index: SlideIndex
    on_error: str
    record_failures: bool
    report_failures: bool
    failures: list[dict[str, Any]]
    failure_count: int
    slide_faults: dict[int, str]
    _paths: list[str]
    _reported: set[int]
    _unreported: dict[int, tuple[int, dict[str, Any]]]
    _transient_logged: set[int]
    _quarantine: Quarantine | None
    _quarantine_unwritable: bool

    def _keep(self, entry: dict[str, Any]) -> None:
        self.failure_count += 1
        if len(self.failures) < FAILURES_KEPT:
            self.failures.append(entry)

    def _transient(self, slide_id: int, error: TransientReadError) -> None:
        """Report a resource error (once per slide per process in the log; always counted)."""
        self._keep({"kind": "transient", "slide_id": slide_id, "error": str(error)})
        if slide_id not in self._transient_logged:
            self._transient_logged.add(slide_id)
            log.warning("%s (not quarantined: the slide is fine)", str(error))

    def _slide_fault(self, slide_id: int, error: SlideError) -> None:
        """Report a slide that cannot be opened: once per slide per process."""
        reason = str(error)
        if self.slide_faults.get(slide_id) == reason:
            return
        self.slide_faults[slide_id] = reason
        record = self.index.slides[slide_id]
        log.warning(
            "slide %s cannot be read, its tiles are not ok: %s", self._paths[slide_id], reason
        )
        entry = {
            "kind": "slide",
            "slide_id": slide_id,
            "path": record.path,
            "fingerprint": record.fingerprint,
            "error": reason,
            "policy": self.on_error,
        }
        self._keep(entry)
        if not self.record_failures:
            return
        try:
            self._kept_quarantine().append_slide(entry)
        except OSError as exc:
            self._unrecorded(exc)

    def _record(self, row: int, error: TileReadError) -> dict[str, Any]:
        """Keep a tile failure and append it to the quarantine; the record."""
        cols = self.index.columns
        slide_id = int(cols["slide_id"][row])
        x, y = int(cols["l0_x"][row]), int(cols["l0_y"][row])
        entry = {
            "kind": "tile",
            "slide_id": slide_id,
            "path": self.index.slides[slide_id].path,
            "fingerprint": self.index.slides[slide_id].fingerprint,
            "x": x,
            "y": y,
            "level": int(cols["level"][row]),
            "row": int(row),
            "error": error.cause or str(error),
            "policy": self.on_error,
        }
        self._keep(entry)
        if not self.record_failures:
            return entry
        try:
            self._kept_quarantine().record_tile(entry)
        except OSError as exc:
            self._unrecorded(exc)
        return entry

    def _report_tile_failures(self, rows: npt.NDArray[np.int64]) -> None:
        """Say the tile failures of slides whose first ones this call met: one WARNING per
        slide per process, with the count in this read. A slide that fails 13% of its tiles
        would otherwise go unnoticed, since failed tiles only come back not ok; logging each
        one would bury everything else (every epoch meets them again)."""
        slide_ids = self.index.columns["slide_id"][rows]
        kept = "the dataset's failures"
        if self.record_failures and not self._quarantine_unwritable:
            kept += f" and the quarantine ({self.index.quarantine.path})"
        for slide_id, (count, first) in self._unreported.items():
            self._reported.add(slide_id)
            log.warning(
                "%d of %d tiles of slide %s in this read failed and are not ok (on_error=%s; "
                "the first at level-0 (%d, %d): %s). Later tile failures of this slide are not "
                "logged by this process: %s list every one",
                count,
                int(np.count_nonzero(slide_ids == slide_id)),
                self._paths[slide_id],
                self.on_error,
                first["x"],
                first["y"],
                first["error"],
                kept,
            )
        self._unreported.clear()

    def _kept_quarantine(self) -> Quarantine:
        """One Quarantine object per reader: it remembers the records it has seen, so a
        failure recorded already is not read from the file again."""
        if self._quarantine is None:
            self._quarantine = self.index.quarantine
        return self._quarantine

    def _unrecorded(self, error: OSError) -> None:
        """A quarantine write failed (a read-only index): said once per process, since every
        failed tile would say it again; the failures stay in the batches and `failures`."""
        if self._quarantine_unwritable:
            log.debug("quarantine not written: %s", error)
            return
        self._quarantine_unwritable = True
        log.warning(
            "cannot write the quarantine %s (%s): failed reads are still reported (ok=False, "
            "dataset.failures) but not recorded; pass quarantine=FILE (--quarantine FILE) to "
            "record them in a file you can write (said once per process)",
            self.index.quarantine.path,
            error,
        )
