"""The byte ranges of remote objects that a process fetched or is fetching, bounded in bytes.

One `RangeStore` per process (the handle pool's), shared by its threads. It is the request
planner's memory and the cache of fetched bytes at once:

* `RangeStore.start` is given the ranges the reader will want (the current batch and the
  look-ahead's next ones): ranges inside a block already fetched or in flight are not asked
  again; the rest are merged by the store's `_request_plan.CostModel` into requests;
* `RangeStore.take` serves a range from any block that holds all of it (waiting for one in
  flight), so a range inside, touching or overlapping others is cut from the request that
  fetched it; a second epoch over the same tiles asks for nothing still held;
* blocks are kept until their room is needed, least recently used first out; blocks in
  flight are never dropped (somebody waits for them), so a start that finds no room asks
  for nothing (the read fetches it then).

Blocks are keyed by the object's URL *and version* (ETag or modification time, read when the
slide was opened): bytes of a rewritten object are never served for the new one.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from wsi_loader.slides.storage._request_plan import MAX_REQUEST, CostModel, Range, coalesce_groups

log = logging.getLogger(__name__)

DEFAULT_BYTES = 256 * 2**20
DEFAULT_DEADLINE_S = 30.0  # the longest any one request to a store may take
Key = tuple[str, str]  # (url, version)


class Source(Protocol):
    """What the store needs of a remote object (`storage.RemoteBytes`)."""

    @property
    def key(self) -> Key: ...

    @property
    def model(self) -> CostModel: ...

    def submit(self, offset: int, size: int) -> concurrent.futures.Future[bytes]: ...


class _Block:
    """A fetched or in-flight range. Once read it keeps its bytes and drops its future (a
    future is a handful of objects that the garbage collector would walk for as long as the
    block is kept: thousands of blocks within the default budget)."""

    __slots__ = ("data", "end", "future", "offset", "size")

    def __init__(self, offset: int, size: int, future: concurrent.futures.Future[bytes]) -> None:
        self.offset, self.size, self.end = offset, size, offset + size
        self.future: concurrent.futures.Future[bytes] | None = future
        self.data: bytes | None = None

    def landed(self) -> bool:
        return self.data is not None or (self.future is not None and self.future.done())


class RangeStore:
    """Fetched and in-flight byte ranges of one process, at most ``max_bytes`` (see the
    module doc). Picklable (its budget only); a forked child starts empty."""

    def __init__(
        self, max_bytes: int = DEFAULT_BYTES, deadline_s: float = DEFAULT_DEADLINE_S
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.max_bytes = max_bytes
        # the longest a request of this process's readers may take: a store that does not
        # answer by then fails the read as a transient error (`RemoteBytes.read`)
        self.deadline_s = float(deadline_s)
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._blocks: OrderedDict[tuple[Key, int], _Block] = OrderedDict()  # LRU order
        self._starts: dict[Key, list[int]] = {}  # sorted block offsets per object
        self._longest: dict[Key, int] = {}  # the largest block ever held of each object
        self._bytes = 0
        # counters, for benchmarks and `wsi-loader bench`
        self.requests = 0  # range requests made (not counting hedges)
        self.bytes_fetched = 0
        self.bytes_read = 0
        self.hits = 0  # ranges read from bytes that were here already (no wait)
        self.reads = 0  # ranges read
        self.evicted = 0  # bytes dropped for room
        self.hedged = 0  # second requests sent for slow ones (set by storage)

    def __getstate__(self) -> dict[str, float]:
        return {"max_bytes": self.max_bytes, "deadline_s": self.deadline_s}

    def __setstate__(self, state: dict[str, float]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's futures are not ours
            self._reset()

    # -- lookup ------------------------------------------------------------------------------
    def _holding(self, key: Key, offset: int, size: int) -> _Block | None:
        """A block that holds all of ``offset .. offset + size`` (lock held)."""
        starts = self._starts.get(key)
        if not starts:
            return None
        end = offset + size
        reach = end - self._longest[key]  # blocks that start before this end before ``end``
        blocks = self._blocks
        at = bisect.bisect_right(starts, offset)
        while at > 0:
            at -= 1
            start = starts[at]
            if start < reach:
                return None
            block = blocks[(key, start)]
            if block.end >= end:
                return block
        return None

    def holds(self, key: Key, offset: int, size: int) -> bool:
        self._check_process()
        with self._lock:
            return self._holding(key, offset, size) is not None

    # -- planning and fetching ---------------------------------------------------------------
    def start(self, source: Source, ranges: Iterable[Range]) -> None:
        """Start fetching the ``ranges`` of ``source`` that no block holds, merged by its cost
        model, as far as the budget allows."""
        self._check_process()
        key = source.key
        with self._lock:
            todo = [r for r in ranges if self._holding(key, *r) is None]
            if not todo:
                return
            largest = min(MAX_REQUEST, max(self.max_bytes // 4, 1))  # a few fit the budget
            for (offset, size), members in coalesce_groups(todo, source.model.merge_gap(), largest):
                if len(members) > 1 and self._holding(key, offset, size) is not None:
                    continue  # (a single range was looked up above)
                if not self._make_room(size):
                    log.debug("range budget of %d bytes is spent", self.max_bytes)
                    break
                self._add(key, _Block(offset, size, source.submit(offset, size)))
                self.requests += 1
                self.bytes_fetched += size

    def _add(self, key: Key, block: _Block) -> None:
        old = self._blocks.pop((key, block.offset), None)
        if old is not None:
            self._bytes -= old.size
        else:
            bisect.insort(self._starts.setdefault(key, []), block.offset)
        self._longest[key] = max(self._longest.get(key, 0), block.size)
        self._blocks[(key, block.offset)] = block
        self._bytes += block.size

    def _make_room(self, size: int) -> bool:
        if self._bytes + size <= self.max_bytes:
            return True
        if size > self.max_bytes:
            return False
        needed = self._bytes + size - self.max_bytes
        dropped = []
        for place, block in self._blocks.items():  # least recently used first
            if needed <= 0:
                break
            if block.landed():  # one in flight: somebody waits for it
                dropped.append((place, block.size))
                needed -= block.size
        for (key, offset), size_of in dropped:
            self._remove(key, offset)
            self.evicted += size_of
        return self._bytes + size <= self.max_bytes

    def _remove(self, key: Key, offset: int) -> None:
        block = self._blocks.pop((key, offset), None)
        if block is None:
            return
        self._bytes -= block.size
        starts = self._starts[key]
        del starts[bisect.bisect_left(starts, offset)]
        if not starts:
            del self._starts[key], self._longest[key]

    def take(self, key: Key, offset: int, size: int) -> bytes | None:
        """The bytes of a range from a block that holds it (waiting for one in flight); None
        when none does, or its fetch failed (the caller fetches it, with retries)."""
        self._check_process()
        with self._lock:
            block = self._holding(key, offset, size)
            if block is None:
                return None
            self._blocks.move_to_end((key, block.offset))
            data, future = block.data, block.future
            ready = data is not None or (future is not None and future.done())
        if data is None:
            assert future is not None
            try:
                data = future.result()
            except Exception as exc:  # fetched again (with retries) by the caller
                log.debug("prefetch of %s failed: %s", key[0], exc)
                with self._lock:
                    if self._blocks.get((key, block.offset)) is block:
                        self._remove(key, block.offset)
                return None
        start = offset - block.offset
        with self._lock:
            block.data, block.future = data, None
            self.reads += 1
            self.hits += ready
            self.bytes_read += size
        if start == 0 and size == len(data):
            return data  # the whole block: no copy
        return data[start : start + size]

    def forget(self, url: str) -> None:
        """Drop every landed block of ``url`` (any version)."""
        self._check_process()
        with self._lock:
            for key, offset in list(self._blocks):
                if key[0] == url and self._blocks[(key, offset)].landed():
                    self._remove(key, offset)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, int]:
        """Counters for `wsi-loader bench` and the benchmarks."""
        return {
            "requests": self.requests,
            "bytes_fetched": self.bytes_fetched,
            "bytes_read": self.bytes_read,
            "reads": self.reads,
            "hits": self.hits,
            "evicted": self.evicted,
            "hedged": self.hedged,
        }
