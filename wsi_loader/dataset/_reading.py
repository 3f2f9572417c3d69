"""Read index rows into pixels, surviving bad data. Shared by every dataset and the exporter.

A failed read discards the handle (OpenSlide errors latch), reopens it and retries a bounded
number of times; then the policy applies: ``fill`` (constant colour, not ok), ``substitute``
(a deterministic other tile of the same slide, not ok, marked substituted) or ``raise``
(`TileReadError`). Every failure is appended to the index's quarantine and kept in
``TileReader.failures`` (a bounded sample; ``failure_count`` counts them all).

A slide that cannot be opened at all (gone, unreadable) is a *slide* fault: its tiles come back
not ok without retries, one WARNING per slide per process and one slide-level quarantine record
say so, and no tile of it is quarantined (it is read again once it is back). Nothing here
imports torch: batches are numpy NHWC uint8 buffers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from wsi_loader.dataset._context import (
    Box,
    ContextPlan,
    Scale,
    fill_outside,
    main_centre,
    manifest_mpp,
    plan_context,
)
from wsi_loader.errors import (
    ResolutionError,
    SlideChangedError,
    SlideError,
    TileReadError,
    TransientReadError,
    is_transient,
)
from wsi_loader.index._fingerprints import content_key, identify
from wsi_loader.index._quarantine import Quarantine
from wsi_loader.index._table import SlideIndex
from wsi_loader.slides._base import (
    PlansReads,
    PlansSegments,
    Prefetching,
    ReadsEncoded,
    ReadsInto,
    ReadsScaled,
    RGBArray,
    SegmentJob,
    SegmentKey,
    SlideMeta,
    SlideReader,
    level_to_l0,
    resize,
    supports,
)
from wsi_loader.slides._pool import HandlePool
from wsi_loader.slides.storage._sources import is_url, survives_fork

log = logging.getLogger(__name__)

OnError = Literal["fill", "substitute", "raise"]
ON_ERROR: tuple[str, ...] = ("fill", "substitute", "raise")
SUBSTITUTE_ATTEMPTS = 3
BACKOFF_S = 0.05  # first wait before retrying a resource error (doubles, at most 1 s)
FAILURES_KEPT = 1000  # failures kept in TileReader.failures (all are counted)
# Starting threads costs ~0.2 ms per read: measured, 2 threads lose on 2-tile reads (0.89x)
# and win from 4 tiles on (1.23x at 4, 1.35x at 8, 1.5-1.7x at 64)
MIN_THREADED_JOBS = 4


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's CPU set)."""
    return len(_affinity())


def threads_per_process(processes: int) -> int:
    """Threads for each of ``processes`` reading processes: the usable cores shared out."""
    return max(1, usable_cores() // max(1, processes))


def _idle_seconds(cpus: set[int]) -> float | None:
    """Idle + iowait time of the given CPUs since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            idle += int(fields[3]) + int(fields[4])
    return idle / ticks


class FreeCores:
    """How many cores this process could use now: its usable cores minus what other processes
    keep busy, measured over the last interval (its own CPU time plus the idle time of its
    cores, per second of wall time).

    Why: one decode thread per usable core is 1.3-1.7x one thread on an idle 2-core machine,
    but 0.8-0.9x when another process keeps a core busy (threads wait for a core and thrash
    caches). Measuring the load picks the right count in both states. Linux only (elsewhere
    the cores are taken as free). Sampled at most every ``interval`` seconds; reset after a
    fork (the counters are per process).
    """

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._pid = -1
        self._last: tuple[float, float, float] | None = None
        self._free: float | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"interval": self.interval, "_pid": -1, "_last": None, "_free": None}

    def __call__(self, limit: int) -> int:
        """At most ``limit``, at least 1."""
        if limit <= 1:
            return 1
        if self._pid != os.getpid():
            self._pid, self._last, self._free = os.getpid(), None, None
        now = time.monotonic()
        # /proc/stat is read only when a new sample is due, not at every batch
        if self._last is None or now - self._last[0] >= self.interval:
            idle = _idle_seconds(_affinity())
            if idle is None:
                return limit
            sample = (now, time.process_time(), idle)
            if self._last is not None:
                wall = sample[0] - self._last[0]
                own = (sample[1] - self._last[1]) / wall
                spare = (sample[2] - self._last[2]) / wall
                self._free = own + spare
            self._last = sample
        if self._free is None:
            return limit
        return max(1, min(limit, int(self._free + 0.5)))


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))


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
    # context tile that is on the slide (N, scales, 4: x0, y0, x1, y1; see dataset.context)
    context: list[npt.NDArray[np.uint8]] = field(default_factory=list)
    context_inside: npt.NDArray[np.int32] | None = None


class TileReader:
    """Reads tiles of a `SlideIndex` through a per-process `HandlePool`.

    Pickles without open handles (the pool keeps only its options), so it can live inside a
    Dataset handed to spawned DataLoader workers.
    """

    def __init__(
        self,
        index: SlideIndex,
        *,
        on_error: str = "fill",
        retries: int = 2,
        fill_value: int = 255,
        pool: HandlePool | None = None,
        backend: str | None = None,
        record_failures: bool = True,
        report_failures: bool = True,
        context: Sequence[Scale] = (),
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if not 0 <= retries <= 10:
            raise ValueError(f"retries must be between 0 and 10, got {retries}")
        if not 0 <= fill_value <= 255:
            raise ValueError(f"fill_value must be between 0 and 255, got {fill_value}")
        self.index = index
        self.on_error = on_error
        self.retries = retries
        self.fill_value = fill_value
        self.pool = pool if pool is not None else HandlePool()  # an empty pool is falsy
        self.backend = backend or "auto"  # per process: the fastest correct reader
        self.record_failures = record_failures
        # one WARNING per slide per process for failed tiles (see `_report_tile_failures`)
        self.report_failures = report_failures
        self._reported: set[int] = set()
        self._unreported: dict[int, tuple[int, dict[str, Any]]] = {}  # this call's: count, first
        self.tile_size = int(index.params["tile_size"])
        # co-centred context tiles read beside each row (see wsi_loader.dataset._context)
        self.context: list[Scale] = [(float(m), int(s)) for m, s in context]
        # by slide, in this process: the meta its reader reports and one plan per scale
        self._context_plans: dict[int, tuple[SlideMeta, list[ContextPlan]]] = {}
        self.failures: list[dict[str, Any]] = []
        self.failure_count = 0
        self.slide_faults: dict[int, str] = {}  # slide id -> reason, found by this process
        self._transient_logged: set[int] = set()
        self.on_slide: Callable[[int], None] | None = None  # told which slide is read next
        self._quarantine: Quarantine | None = None  # kept: it knows the tiles recorded
        self._quarantine_unwritable = False
        self._paths = [index.slide_path(i) for i in range(len(index.slides))]
        self._contents = {p: s.content for p, s in zip(self._paths, index.slides, strict=True)}
        self._fingerprints = {
            p: s.fingerprint for p, s in zip(self._paths, index.slides, strict=True) if is_url(p)
        }
        # files found to be the indexed slide, by (device, inode, size, mtime): an OpenSlide
        # slide reopened batch after batch is hashed once, not at every open
        self._verified: dict[str, tuple[int, int, int, int]] = {}
        self._slide_start = index.slide_starts()
        self.remote = any(is_url(p) for p in self._paths)  # slides on object storage
        # whether processes forked after this one read its slides can read them (obstore's
        # clients cannot; libcurl's are made per process)
        self.fork_safe = all(survives_fork(p) for p in self._paths)
        self._announced = np.zeros(0, dtype=np.int64)  # rows the last look-ahead named

    def _verify(self, path: str) -> None:
        """Refuse a file that is not the slide indexed at ``path`` (size and head/tail digest;
        a ``touch`` passes). Run on every fresh open; kept layouts reopened on an unchanged
        file skip it."""
        expected = self._contents.get(path)
        if expected is None:
            return  # an index from before content digests
        if is_url(path):
            self._verify_remote(path)
            return
        try:
            st = os.stat(path)
            identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if self._verified.get(path) == identity:
                return  # hashed already in this process, and the file has not changed since
            found = content_key(path)
        except OSError:
            return  # the open that follows reports it
        if found == expected:
            self._verified[path] = identity
        else:
            raise SlideChangedError(
                "the file is not the slide that was indexed (its size or contents changed); "
                "rebuild the index",
                path=path,
            )

    def _verify_remote(self, path: str) -> None:
        """`_verify` for an object: its fingerprint, which covers the object's version (ETag)
        besides its size and first and last 64 KiB. A file can be rewritten in the middle
        without a trace in those; an object cannot be rewritten without a new version."""
        expected = self._fingerprints.get(path)
        if expected is None:
            return
        if identify(path)[2] != expected:
            raise SlideChangedError(
                "the object is not the slide that was indexed (rewritten since: another "
                "version, size or contents); rebuild the index",
                path=path,
            )

    def get_reader(self, slide_id: int) -> SlideReader:
        """This process's open reader of a slide (opened and verified as needed)."""
        if self.on_slide is not None:
            self.on_slide(slide_id)
        return self.pool.get(self._paths[slide_id], self.backend, self._verify)

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
                    if size == t and supports(reader, ReadsInto):
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

    # -- failures --------------------------------------------------------------------------
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

    # -- public ----------------------------------------------------------------------------
    def prefetch(self, rows: npt.ArrayLike) -> None:
        """Start fetching the bytes of ``rows`` in the background and return: coalesced,
        concurrent range requests for remote slides (within the pool's ``prefetch_bytes``),
        kernel read-ahead for local raw-read files. Slides not open yet are opened for it: a
        remote one when the pool can hold them all; a local one indexed as raw-read while the
        pool has room (a reader's first call names its next batches before it has read
        anything: skipped, they were read cold), never by closing one, nor one OpenSlide reads
        (nothing to ask ahead). Slides that cannot be opened are skipped here (their reads
        report them)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if not len(rows) or rows.min() < 0 or rows.max() >= len(self.index):
            return
        windows = self._windows(rows)
        by_slide: dict[int, list[tuple[int, int, int, int, int]]] = {}
        rows_of: dict[int, list[int]] = {}
        for row, (slide_id, x, y, level, size) in zip(rows.tolist(), windows, strict=True):
            by_slide.setdefault(slide_id, []).append((x, y, level, size, size))
            rows_of.setdefault(slide_id, []).append(row)
        room = self.pool.open_limit - len(self.pool)
        for slide_id, wanted in by_slide.items():
            if slide_id in self.slide_faults:
                continue
            path = self._paths[slide_id]
            try:
                reader = self.pool.peek(path, self.backend)
                if reader is None and (
                    len(by_slide) <= self.pool.open_limit
                    if is_url(path)
                    else room > 0 and self._asks_ahead(slide_id)
                ):
                    reader = self.pool.get(path, self.backend, self._verify)
                    room -= 1
                if supports(reader, Prefetching):
                    reader.prefetch(wanted, self.tile_size)
                    if self.context:
                        self._prefetch_context(reader, rows_of[slide_id])
            except SlideError as exc:
                log.debug("prefetch of %s skipped: %s", self._paths[slide_id], str(exc))

    def _prefetch_context(self, reader: Prefetching, rows: list[int]) -> None:
        """`prefetch` of the context windows of ``rows`` (one slide's), scale by scale."""
        per_scale: list[list[tuple[int, int, int, int, int]]] = [[] for _ in self.context]
        for row in rows:
            for k, ((_, x, y, level, read), _) in enumerate(self.context_windows(row)):
                per_scale[k].append((x, y, level, read, read))
        for (_, size), wanted in zip(self.context, per_scale, strict=True):
            reader.prefetch(wanted, size)

    def _asks_ahead(self, slide_id: int) -> bool:
        """Whether this process reads the slide with the raw reader, whose reads can be asked
        of the kernel ahead (as it was indexed; not when OpenSlide is asked for)."""
        return self.backend in ("auto", "tiff") and self.index.slides[slide_id].backend == "tiff"

    def read(
        self,
        rows: npt.ArrayLike,
        out: npt.NDArray[np.uint8] | None = None,
        encoded: bool = False,
        threads: int = 1,
        ahead: npt.ArrayLike | None = None,
        context_out: Sequence[npt.NDArray[np.uint8]] | None = None,
    ) -> ReadResult:
        """Read ``rows`` into one (N, H, W, 3) buffer, grouped by slide for handle locality,
        and their context tiles (``context``) into one (N, size, size, 3) buffer per scale
        (``context_out``, or new ones): more windows of the same rows, planned and decoded
        together with the main windows, so that the storage segments overlapping windows
        share are decoded once.

        For remote slides the bytes of all ``rows`` are requested first, together
        (`prefetch`); then those of ``ahead`` (rows the caller reads next, local or remote);
        then the tiles are decoded: remote tiles arrive concurrently, and the next reads'
        bytes travel while this one decodes.

        With ``encoded``, rows that are exactly one JPEG storage tile are not decoded: their
        compressed stream goes to ``result.encoded[i]`` (pixels left zero) for a GPU decoder.
        With ``threads`` > 1, that many threads started for this call do the decoding (see
        `_read_in_threads`); the result is the same as with one. A row whose context tile
        cannot be read fails as a whole (the failure policy applies to the row: ``fill``
        fills its tile and context tiles, ``substitute`` reads another row with its context).
        """
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n, t = len(rows), self.tile_size
        if out is None:
            out = np.empty((n, t, t, 3), dtype=np.uint8)
        elif out.shape != (n, t, t, 3) or out.dtype != np.uint8:
            raise ValueError(
                f"out must be uint8 of shape {(n, t, t, 3)}, got {out.shape} {out.dtype}"
            )
        result = ReadResult(
            pixels=out,
            ok=np.ones(n, dtype=bool),
            substituted=np.zeros(n, dtype=bool),
            source_rows=rows.copy(),
            errors=[None] * n,
            encoded=[None] * n if encoded else None,
            context=self._context_buffers(n, context_out),
            context_inside=np.zeros((n, len(self.context), 4), dtype=np.int32),
        )
        if n and (rows.min() < 0 or rows.max() >= len(self.index)):
            raise IndexError(f"rows out of range 0..{len(self.index) - 1}")
        if self.remote:  # local reads of these rows follow at once: no read-ahead to win
            self.prefetch(rows)
        elif ahead is not None and n > 1:
            # a look-ahead reader's first batch, which nobody could announce: all its tiles
            # asked of the kernel at once are read concurrently, not one by one as decoded
            unannounced = rows[~np.isin(rows, self._announced)]
            if len(unannounced):
                self.prefetch(unannounced)
        if ahead is not None:
            # each batch names the next few: only rows not named by the previous call are new
            ahead = np.asarray(ahead, dtype=np.int64).reshape(-1)
            fresh = ahead[~np.isin(ahead, self._announced)]
            self._announced = ahead
            self.prefetch(fresh)
        windows = self._windows(rows)
        todo = np.argsort(self.index.columns["slide_id"][rows], kind="stable").tolist()
        order = list(todo)  # every row's context windows are read, encoded rows' too
        if result.encoded is not None:
            for i in todo:
                result.encoded[i] = self._encoded(windows[i])
                if result.encoded[i] is not None:
                    result.pixels[i] = 0
            todo = [i for i in todo if result.encoded[i] is None]
        context_done: set[tuple[int, int]] = set()  # (position, scale) read by the threads
        if threads > 1 and (len(todo) > 1 or self.context):
            reads = [(windows[i], result.pixels[i]) for i in todo]
            places = [(i, -1) for i in todo]  # (position in rows, context scale or -1)
            for i in order if self.context else ():
                for k, (window, _) in enumerate(self._context_windows(int(rows[i]), quiet=True)):
                    reads.append((window, result.context[k][i]))
                    places.append((i, k))
            done = {places[n] for n in self._read_in_threads(reads, threads)}
            todo = [i for i in todo if (i, -1) not in done]
            context_done = {place for place in done if place[1] >= 0}
        faulted: dict[int, SlideError] = {}  # slides of this call that could not be read
        # The common case first: a window straight into its slot by a reader fetched once per
        # slide (``todo`` is grouped by slide). Anything else, and a read that fails, takes
        # `_read_into` (retries, failure policy): one place decides what a failure means.
        # (read_batch of aligned JPEG tiles: 314 -> 306 us a tile, decode ~290 us.)
        reader, reader_of = None, -1
        try:
            for i in todo:
                slide_id, x, y, level, size = windows[i]
                tried = None
                if size == t and slide_id not in faulted:
                    if slide_id != reader_of:
                        reader, reader_of = self._reader_into(slide_id), slide_id
                    if reader is not None:
                        try:
                            reader.read_region_into(result.pixels[i], x, y, level, size, size)
                            if self.slide_faults:  # the slide is back: a later fault is reported
                                self.slide_faults.pop(slide_id, None)
                            continue
                        except SlideError as exc:
                            self.pool.discard(self._paths[slide_id], self.backend)  # may be latched
                            reader, reader_of, tried = None, -1, exc
                self._read_into(int(rows[i]), windows[i], i, result, faulted, tried)
            if self.context:
                self._read_contexts(rows, order, result, faulted, context_done)
            self._report_tile_failures(rows)
        finally:
            # the errors' tracebacks hold the frames that hold them and ``result``
            faulted.clear()
            tried = None
            self._unreported.clear()  # raised instead (on_error="raise"): the error says it
        return result

    def _reader_into(self, slide_id: int) -> ReadsInto | None:
        """The slide's reader when it reads straight into a buffer; None when it does not, or
        cannot be had now (`_read_into` then tries again, and reports)."""
        try:
            reader = self.get_reader(slide_id)
        except SlideError:
            return None
        return reader if supports(reader, ReadsInto) else None

    def _read_in_threads(
        self, reads: list[tuple[tuple[int, int, int, int, int], RGBArray]], threads: int
    ) -> set[int]:
        """Do the expensive part of ``reads`` (windows and their destinations) on ``threads``
        threads; returns the positions in ``reads`` that are read completely (the serial path
        reads the others, in part from the segments decoded here).

        This thread asks each window's reader for work that another thread may do: a read
        straight into the window's destination (a whole JPEG storage tile; any OpenSlide
        read, whose handles are thread-safe), or the decodes of the storage segments the window
        needs, which go into the reader's cache, so that the serial read of the window only
        stitches (a segment shared by windows, a main tile's and its neighbours' context
        windows, is decoded once). The pool, the caches and the failure bookkeeping stay on
        this thread. Every failure is left to the serial path, which reads the window again
        with its retries and failure policy: one place decides what a failure means. The
        threads end with the call, so none is alive when a DataLoader forks its workers.
        """
        jobs: dict[int, Callable[[], None]] = {}
        segments: dict[SegmentKey, tuple[PlansSegments, SegmentJob]] = {}
        budget = 0  # segment bytes planned: at most half the cache, so none is evicted unused
        # planned reads of a slide whose handle a later window evicts still need it
        with self.pool.holding():
            for n, ((slide_id, x, y, level, size), dest) in enumerate(reads):
                out = int(dest.shape[0])
                try:
                    reader = self.get_reader(slide_id)
                    job = None
                    if supports(reader, PlansReads):
                        job = reader.read_job(dest, x, y, level, size, size)
                    if job is not None:
                        jobs[n] = job
                    elif supports(reader, PlansSegments):
                        room = reader.segment_cache_bytes() // 2
                        wanted = reader.segment_jobs(x, y, level, size, size, out, out, segments)
                        for segment in wanted:  # (the segments planned already not read again)
                            if budget + segment.nbytes <= room:
                                segments[segment.key] = (reader, segment)
                                budget += segment.nbytes
                except SlideError:
                    continue  # read again, and reported, by the serial path
            if len(jobs) + len(segments) < MIN_THREADED_JOBS:
                return set()
            with ThreadPoolExecutor(
                min(threads, len(jobs) + len(segments)), thread_name_prefix="wsi-decode"
            ) as pool:
                done = {n: pool.submit(job) for n, job in jobs.items()}
                decoded = {key: pool.submit(job.decode) for key, (_, job) in segments.items()}
        for key, future in decoded.items():
            if future.exception() is None:
                segments[key][0].keep(key, future.result())
        return {n for n, future in done.items() if future.exception() is None}

    def _encoded(self, window: tuple[int, int, int, int, int]) -> bytes | None:
        """Compressed stream of a window when its reader can hand one out; None otherwise (and
        on any error: the normal path then reads it and applies the failure policy)."""
        slide_id, x, y, level, size = window
        if size != self.tile_size:
            return None
        try:
            reader = self.get_reader(slide_id)
            if not supports(reader, ReadsEncoded):
                return None
            return reader.read_encoded(x, y, level, size, size)
        except SlideError:
            return None

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

    # -- context tiles ---------------------------------------------------------------------
    def _context_buffers(
        self, n: int, given: Sequence[npt.NDArray[np.uint8]] | None
    ) -> list[npt.NDArray[np.uint8]]:
        shapes = [(n, size, size, 3) for _, size in self.context]
        if given is None:
            return [np.empty(shape, dtype=np.uint8) for shape in shapes]
        found = [(tuple(a.shape), a.dtype) for a in given]
        if found != [(shape, np.dtype(np.uint8)) for shape in shapes]:
            raise ValueError(f"context_out must be uint8 buffers of shapes {shapes}, got {found}")
        return list(given)

    def _plans(self, slide_id: int) -> tuple[SlideMeta, list[ContextPlan]]:
        """The slide's meta (as this process's reader sees it) and its context plans. A slide
        that cannot serve a scale raises `ResolutionError`, a slide fault."""
        planned = self._context_plans.get(slide_id)
        if planned is None:
            meta = self.get_reader(slide_id).meta
            record = self.index.slides[slide_id]
            tolerance = float(self.index.params.get("mpp_tolerance", 0.1))
            try:
                plans = plan_context(meta, self.context, tolerance, manifest_mpp(record))
            except ResolutionError as exc:
                raise ResolutionError(str(exc), path=self._paths[slide_id]) from exc
            planned = self._context_plans[slide_id] = (meta, plans)
        return planned

    def context_windows(self, row: int) -> list[tuple[tuple[int, int, int, int, int], Box]]:
        """Per context scale, the window of index row ``row`` (slide id, level-0 x, y, level,
        window edge in level pixels) and its box on the slide (see `wsi_loader.dataset._context`).
        Opens the slide; raises `SlideError` when it cannot be read."""
        cols = self.index.columns
        slide_id = int(cols["slide_id"][row])
        meta, plans = self._plans(slide_id)
        x, y = int(cols["l0_x"][row]), int(cols["l0_y"][row])
        centre_x, centre_y = main_centre(
            meta, x, y, int(cols["level"][row]), int(cols["read_size"][row])
        )
        found = []
        for plan in plans:
            l_x, l_y = plan.place(centre_x, centre_y)
            l0_x, l0_y = level_to_l0(l_x, plan.downsample), level_to_l0(l_y, plan.downsample)
            found.append(
                ((slide_id, l0_x, l0_y, plan.level, plan.read_size), plan.inside(l_x, l_y))
            )
        return found

    def _context_windows(
        self, row: int, quiet: bool = False
    ) -> list[tuple[tuple[int, int, int, int, int], Box]]:
        """`context_windows`; with ``quiet``, none for a slide that cannot be read (the serial
        path reads it again and reports)."""
        try:
            return self.context_windows(row)
        except SlideError:
            if quiet:
                return []
            raise

    def _read_context_of(
        self, row: int, i: int, result: ReadResult, done: frozenset[int] = frozenset()
    ) -> None:
        """Read the context tiles of ``row`` into slot ``i`` (scales in ``done`` were read by
        the threads), fill what is off the slide, and note the boxes on it. A failed window
        raises `TileReadError` naming the scale."""
        assert result.context_inside is not None
        for k, (window, box) in enumerate(self.context_windows(row)):
            tile = result.context[k][i]
            if k not in done:
                try:
                    self._read_window(window, tile)
                except TileReadError as exc:
                    mpp, size = self.context[k]
                    raise TileReadError(
                        f"context tile {k + 1} ({size} px at {mpp:g} um/px): {exc}",
                        path=exc.path,
                        l0_x=exc.l0_x,
                        l0_y=exc.l0_y,
                        level=exc.level,
                        cause=f"context {mpp:g} um/px: {exc.cause or exc}",
                    ) from exc
            fill_outside(tile, box, self.fill_value)
            result.context_inside[i, k] = box

    def _read_contexts(
        self,
        rows: npt.NDArray[np.int64],
        order: list[int],
        result: ReadResult,
        faulted: dict[int, SlideError],
        done: set[tuple[int, int]],
    ) -> None:
        """Read the context tiles of every row whose main window was read (failed rows are
        filled; substituted ones were read with their substitute), with the failure policy."""
        threaded: dict[int, set[int]] = {}
        for i, k in done:
            threaded.setdefault(i, set()).add(k)
        slides = self.index.columns["slide_id"]
        for i in order:
            if not result.ok[i] or result.substituted[i]:
                continue
            row = int(rows[i])
            skip = frozenset(threaded.get(i, ()))
            self._read_into(
                row,
                (int(slides[row]), 0, 0, 0, 0),
                i,
                result,
                faulted,
                read=partial(self._read_context_of, row, i, result, skip),
            )

    def close(self) -> None:
        self.pool.close()
