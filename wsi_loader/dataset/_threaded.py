"""Batches read by a thread of the consuming process, ahead of the consumer: `make_loader`'s
thread path (see `wsi_loader.dataset._choice` for when it is chosen).

The reading thread runs the same single-process DataLoader iteration as ``num_workers=0``
(sampler, batch read with the dataset's decode threads, pinning), so the batches, failure
records and quarantine are those of any other path; only who waits differs: the consumer
finds the next batch read while it used the last one.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# how long `close` waits for a read in progress to end before leaving the (daemon) thread
CLOSE_WAIT_S = 30.0
_POLL_S = 0.05  # how often a reading thread held up by a full queue looks for a stop


class _Failed:
    """An error of the reading thread, raised to the consumer in its turn."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def _read(source: Iterator[object], into: queue.Queue[object], stop: threading.Event) -> None:
    """The reading thread: every item of ``source``, then the end or the error, into ``into``."""
    try:
        for item in source:
            if not _put(into, item, stop):
                return
    except BaseException as exc:  # every error reaches the consumer, which raises it
        _put(into, _Failed(exc), stop)
        return
    _put(into, _END, stop)


def _put(into: queue.Queue[object], item: object, stop: threading.Event) -> bool:
    """Queue ``item``; False when told to stop first."""
    while not stop.is_set():
        try:
            into.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


class ReadAhead(Generic[T]):
    """Iterates ``source`` on a thread of its own, at most ``depth`` items ahead of the
    consumer. An error raised by ``source`` is raised to the consumer after the items read
    before it. `close` (at the end, on an error, or when the consumer stops early) stops the
    thread and waits for the read in progress; items read ahead are dropped (their batch
    buffers go back to their ring)."""

    def __init__(self, source: Iterator[T], depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._closed = False
        # the thread holds the queue and the event, not this object: a consumer that drops
        # its iterator lets it be collected, and its finaliser stops the thread
        self._thread = threading.Thread(
            target=_read,
            args=(source, self._queue, self._stop),
            name="wsi-loader-reads",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> ReadAhead[T]:
        return self

    def __next__(self) -> T:
        if self._closed:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        return item  # type: ignore[return-value]

    @property
    def alive(self) -> bool:
        """Whether the reading thread still runs."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the reading thread and wait for it (bounded: a read that hangs is left to its
        daemon thread, with a WARNING)."""
        self._closed = True
        self._stop.set()
        while True:  # unblock a put and drop what was read ahead
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is threading.current_thread():
            return
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning(
                "the loader's reading thread is still in a read after %.0f s; left behind",
                CLOSE_WAIT_S,
            )
        while True:  # an item put while the thread ended
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._stop.set()  # no join in a finaliser: the thread ends at its next put
