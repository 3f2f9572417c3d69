"""Read index rows into pixels, surviving bad data. Shared by every dataset and the exporter.

`TileReader` reads a batch of rows into one NHWC buffer; its base classes read one window
with retries and apply the failure policy (`wsi_loader.dataset._retry`), keep the failure
records (`wsi_loader.dataset._failures`) and read the context tiles
(`wsi_loader.dataset._context_tiles`). Nothing here imports torch: batches are numpy NHWC
uint8 buffers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.dataset._context import ContextPlan, Scale
from wsi_loader.dataset._context_tiles import ContextTiles
from wsi_loader.dataset._failures import ReadResult
from wsi_loader.dataset._retry import ON_ERROR
from wsi_loader.errors import SlideChangedError, SlideError, TransientReadError
from wsi_loader.index._fingerprints import content_key, identify
from wsi_loader.index._quarantine import Quarantine
from wsi_loader.index._table import SlideIndex
from wsi_loader.slides._base import (
    PlansReads,
    PlansSegments,
    Prefetching,
    ReadsEncoded,
    ReadsInto,
    RGBArray,
    SegmentJob,
    SegmentKey,
    SlideMeta,
    SlideReader,
    supports,
)
from wsi_loader.slides._pool import HandlePool
from wsi_loader.slides.storage._sources import is_url, remote_stat, survives_fork

log = logging.getLogger(__name__)

# Starting threads has a fixed cost per read: threads lose on 2-tile reads and win from 4
# tiles on (benchmarks/README.md, "Threads per read")
MIN_THREADED_JOBS = 4


class TileReader(ContextTiles):
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
            found = content_key(path, like=expected)  # a digest of the kind recorded
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
        if identify(path)[2] == expected:
            return
        # the first and last bytes read differently; over plain http a bit flipped on the way
        # does that too: rewritten only when the object's size or date say so now
        record = self.index.slides[self._paths.index(path)]
        stat = remote_stat(path)
        if stat.size != record.size or (
            stat.mtime_ns and record.mtime_ns and stat.mtime_ns != record.mtime_ns
        ):
            raise SlideChangedError(
                "the object is not the slide that was indexed (rewritten since: another "
                "version, size or contents); rebuild the index",
                path=path,
            )
        raise TransientReadError(
            "the object's first and last bytes read differently from the index's while its "
            "size and date are the indexed ones: bytes damaged on the way (plain http has no "
            "TLS to catch them); retried",
            path=path,
        )

    def get_reader(self, slide_id: int) -> SlideReader:
        """This process's open reader of a slide (opened and verified as needed)."""
        if self.on_slide is not None:
            self.on_slide(slide_id)
        return self.pool.get(self._paths[slide_id], self.backend, self._verify)

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

    def close(self) -> None:
        self.pool.close()
