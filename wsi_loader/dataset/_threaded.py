"""Batches read by threads of the consuming process, ahead of the consumer: `make_loader`'s
thread path (see `wsi_loader.dataset._choice` for when it is chosen).

Each reader thread reads whole batches with a copy of the dataset of its own (its own handle
pool and caches, as a worker process has; nothing of them is shared between threads), one
decode thread each: batch ``k`` goes to reader ``k % readers``, as a DataLoader hands batches
to its workers, so the look-ahead tells each reader its own next batches. Why readers rather
than one reader with a decode pool per batch: on an idle 2-core VM two readers read 1.9x one,
one reader with two decode threads 1.6x (the pool's start and its tail, the serial parts of a
batch; benchmarks/README.md, "Threads or processes"). The batches, failure records and
quarantine are those of any other path.
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
Plan = TypeVar("Plan")

THREAD_NAME = "wsi-loader-reads"


def reader_copies(reads: T, count: int) -> list[T]:
    """``count`` copies of ``reads`` without its open handles (a dataset pickles without
    them: each copy opens its own, lazily, in the thread that reads); ``reads`` is untouched."""
    return [pickle.loads(pickle.dumps(reads)) for _ in range(count)]


def read_ahead(
    plans: Iterable[Plan],
    read: Callable[[int, Plan], T],
    readers: int,
    depth: int,
) -> Iterator[T]:
    """``read(k, plan)`` of every plan, on ``readers`` threads (plan ``i`` on reader
    ``k = i % readers``), at most ``depth`` plans ahead of the consumer, in order. An error of
    a read is raised to the consumer in its turn, after the batches before it. When the
    consumer stops (the generator closed, or collected), reads not started are cancelled, the
    ones in progress waited for, and the threads end: none outlives the iteration."""
    if readers < 1 or depth < 1:
        raise ValueError(f"readers and depth must be >= 1, got {readers}, {depth}")
    threads = [
        ThreadPoolExecutor(1, thread_name_prefix=f"{THREAD_NAME}-{k}") for k in range(readers)
    ]
    pending: deque[Future[T]] = deque()
    todo = iter(plans)
    given = 0

    def submit() -> bool:
        nonlocal given
        plan = next(todo, None)
        if plan is None:
            return False
        reader = given % readers
        pending.append(threads[reader].submit(read, reader, plan))
        given += 1
        return True

    try:
        while len(pending) < depth and submit():
            pass
        while pending:
            batch = pending.popleft().result()
            submit()
            yield batch
    finally:
        for future in pending:
            future.cancel()
        pending.clear()
        for pool in threads:
            pool.shutdown(wait=True, cancel_futures=True)
