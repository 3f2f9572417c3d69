"""One window read with retries, and the failure policy applied to a row that could not be
read: where a failure of the pixels the reader decodes is decided (`TileReader`'s base class;
bytes shipped for decoding on the device fail there, in `wsi_loader.device._loader`).

A failed read discards the handle (OpenSlide errors latch), reopens it and retries a bounded
number of times; then the policy applies: ``fill`` (constant colour, not ok), ``substitute``
(a deterministic other tile of the same slide, not ok, marked substituted) or ``raise``
(`TileReadError`). Every failure is appended to the index's quarantine and kept in
``TileReader.failures`` (a bounded sample; ``failure_count`` counts them all).

A slide that cannot be opened at all (gone, unreadable) is a *slide* fault: its tiles come back
not ok without retries, one WARNING per slide per process and one slide-level quarantine record
say so, and no tile of it is quarantined (it is read again once it is back).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

import numpy as np
import numpy.typing as npt

from wsi_loader.dataset._context import needs_bounded_read, read_reduced
from wsi_loader.dataset._failures import FailureRecords, ReadResult
from wsi_loader.errors import SlideError, TileReadError, TransientReadError, is_transient
from wsi_loader.slides._base import (
    ReadsInto,
    ReadsScaled,
    RGBArray,
    SlideReader,
    resize,
    supports,
)
from wsi_loader.slides._pool import HandlePool

log = logging.getLogger(__name__)

OnError = Literal["fill", "substitute", "raise"]
ON_ERROR: tuple[str, ...] = ("fill", "substitute", "raise")
SUBSTITUTE_ATTEMPTS = 3
BACKOFF_S = 0.05  # first wait before retrying a resource error (doubles, at most 1 s)


class RetryPolicy(FailureRecords):
    """Reads windows with retries and applies the failure policy, for `TileReader` (its
    base class; the state is set by `TileReader.__init__`, `get_reader` is `TileReader`'s and
    `_read_context_of` its context tiles')."""

    pool: HandlePool
    backend: str
    retries: int
    fill_value: int
    _slide_start: npt.NDArray[np.int64]
    get_reader: Callable[[int], SlideReader]
    _read_context_of: Callable[[int, int, ReadResult], None]

    # -- one window ------------------------------------------------------------------------
    def _windows(self, rows: npt.NDArray[np.int64]) -> list[tuple[int, int, int, int, int]]:
        """(slide_id, l0_x, l0_y, level, read_size) per row, gathered in one vectorised pass."""
        cols = self.index.columns
        return list(
            zip(
                *(
                    np.asarray(cols[name][rows]).tolist()
                    for name in ("slide_id", "l0_x", "l0_y", "level", "read_size")
                ),
                strict=True,
            )
        )

    def _read_window(
        self,
        window: tuple[int, int, int, int, int],
        dest: RGBArray,
        tried: SlideError | None = None,
    ) -> None:
        """Read one window into ``dest`` (square: its edge is the output size, the row's
        ``tile_size`` or a context tile's), reopening and retrying a bounded number of times;
        raises the last error as `TileReadError`, or as `TransientReadError` when it was a
        resource error (those are retried with backoff). ``tried``: the error of a first
        attempt already made (its handle discarded)."""
        slide_id, x, y, level, size = window
        path, backend, t = self._paths[slide_id], self.backend, int(dest.shape[0])
        last: SlideError | None = tried
        try:
            for attempt in range(0 if tried is None else 1, self.retries + 1):
                if last is not None and is_transient(last):
                    time.sleep(min(BACKOFF_S * 2**attempt, 1.0))
                try:
                    reader = self.get_reader(slide_id)
                except SlideError as exc:
                    if not is_transient(exc):
                        raise  # the slide as a whole (a slide fault): retrying tiles can't help
                    last = exc
                    continue
                try:
                    if needs_bounded_read(reader.meta, x, y, level, size, t):
                        dest[...] = read_reduced(reader, x, y, level, size, t, self.fill_value)
                    elif size == t and supports(reader, ReadsInto):
                        reader.read_region_into(dest, x, y, level, size, size)
                    elif size != t and supports(reader, ReadsScaled):  # DCT downscaling
                        dest[...] = reader.read_region_scaled(x, y, level, size, size, t, t)
                    else:
                        dest[...] = resize(reader.read_region(x, y, level, size, size), t, t)
                    return
                except SlideError as exc:  # includes TileReadError, not found, unopenable
                    self.pool.discard(path, backend)  # its error state may be latched
                    last = exc
                    log.debug(  # the text: a record kept by a handler must not hold the frames
                        "read of %s (%d, %d) failed, try %d: %s", path, x, y, attempt, str(exc)
                    )
            assert last is not None
            if is_transient(last):
                raise TransientReadError(
                    f"read at level-0 ({x}, {y}), level {level} failed for want of a resource "
                    f"after {self.retries + 1} attempts: {last}",
                    path=path,
                ) from last
            if isinstance(last, TileReadError):
                raise last
            raise TileReadError.for_region(path, x, y, level, size, size, last) from last
        finally:
            # ``last``'s traceback holds this frame, which holds ``last`` and ``dest`` (a row
            # of a whole batch buffer): a cycle only a full collection frees, so cut it
            last = tried = None

    def read_window(
        self, slide_id: int, l0_x: int, l0_y: int, level: int, size: int, dest: RGBArray
    ) -> None:
        """Read one window (not necessarily a row of the index) into ``dest``, with the
        retries but without the failure policy: raises `TileReadError` or `SlideError`."""
        self._read_window((slide_id, l0_x, l0_y, level, size), dest)

    # -- the failure policy ----------------------------------------------------------------
    def _read_into(
        self,
        row: int,
        window: tuple[int, int, int, int, int],
        i: int,
        result: ReadResult,
        faulted: dict[int, SlideError],
        tried: SlideError | None = None,
        read: Callable[[], None] | None = None,
    ) -> None:
        """Read slot ``i`` (``read``: by default the row's main window) with the retries, then
        apply the failure policy: the one place that decides what a failure means. ``faulted``:
        slides of this call found unreadable (their other rows fail at once)."""
        slide_id = window[0]
        error = faulted.get(slide_id)
        try:
            if error is None:
                try:
                    if read is None:
                        self._read_window(window, result.pixels[i], tried)
                    else:
                        read()
                except SlideError as exc:
                    error = exc
                else:
                    if self.slide_faults:  # the slide is back: a later fault is reported again
                        self.slide_faults.pop(slide_id, None)
                    return
            self._failed(row, i, error, result, faulted)
        finally:
            error = tried = None  # their tracebacks hold this frame (see `_read_window`)

    def _failed(
        self,
        row: int,
        i: int,
        error: SlideError,
        result: ReadResult,
        faulted: dict[int, SlideError],
    ) -> None:
        """Report a row that could not be read and apply the failure policy to it."""
        slide_id = int(self.index.columns["slide_id"][row])
        result.ok[i] = False
        if isinstance(error, TileReadError):
            entry = self._record(row, error)
            result.errors[i] = error.cause or str(error)
            if self.report_failures and slide_id not in self._reported:
                count, first = self._unreported.get(slide_id, (0, entry))
                self._unreported[slide_id] = (count + 1, first)
        elif isinstance(error, TransientReadError):  # not the data's fault: never quarantined
            faulted[slide_id] = error  # the rest of this call's tiles of the slide fail fast
            self._transient(slide_id, error)
            result.errors[i] = f"resource error: {error}"
        else:  # the whole slide: no substitute from it either
            faulted[slide_id] = error
            self._slide_fault(slide_id, error)
            result.errors[i] = f"slide fault: {error}"
        if self.on_error == "raise":
            raise error
        if self.on_error == "substitute" and isinstance(error, TileReadError):
            found = self._substitute(row, i, result)
            if found is not None:
                result.source_rows[i] = found
                result.substituted[i] = True
                return
        self._fill(i, result)

    def _fill(self, i: int, result: ReadResult) -> None:
        """Slot ``i`` of a row that failed: its tile and context tiles in ``fill_value``."""
        result.pixels[i] = self.fill_value
        for tiles in result.context:
            tiles[i] = self.fill_value
        if result.context_inside is not None:
            result.context_inside[i] = 0

    def _substitute(self, row: int, i: int, result: ReadResult) -> int | None:
        """Read a deterministic other row of the same slide (with its context tiles) into
        slot ``i`` of ``result``; its row, or None."""
        slide_id = int(self.index.columns["slide_id"][row])
        start, stop = int(self._slide_start[slide_id]), int(self._slide_start[slide_id + 1])
        if stop - start < 2:
            return None
        rng = np.random.default_rng([row, 0x5EED])
        tried: set[int] = {row}
        for _ in range(SUBSTITUTE_ATTEMPTS):
            other = int(rng.integers(start, stop))
            if other in tried:
                continue
            tried.add(other)
            try:
                self._read_window(self._windows(np.array([other]))[0], result.pixels[i])
                self._read_context_of(other, i, result)
                return other
            except TileReadError as exc:
                self._record(other, exc)
            except SlideError:
                return None
        return None
