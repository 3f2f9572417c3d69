"""Run independent units of work (slides to index, export units) inline, in local processes or
on any ``concurrent.futures.Executor`` (a Dask cluster's ``client.get_executor()``), with one
progress bar. Shared by the index builder and the exporter; imports neither torch nor dask.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tqdm import tqdm

Task = TypeVar("Task")
Result = TypeVar("Result")


def as_executor(executor: Any) -> cf.Executor | None:
    """Accept a concurrent.futures Executor or a dask.distributed Client (duck-typed, so this
    package needs no dask)."""
    if executor is None or isinstance(executor, cf.Executor):
        return executor
    get_executor = getattr(executor, "get_executor", None)
    if get_executor is None:
        raise TypeError(f"expected an Executor or a dask Client, got {type(executor).__name__}")
    result: cf.Executor = get_executor()
    return result


def progress_bar(total: int, unit: str, desc: str, show: bool) -> tqdm[Any]:
    """A tqdm bar on stderr, shown only when asked for and on a terminal."""
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, disable=None if show else True)


def run_all(
    fn: Callable[[Task], Result],
    tasks: Sequence[Task],
    workers: int,
    executor: Any,
    bar: tqdm[Any],
    weight: Callable[[Task], int] = lambda task: 1,
) -> list[Result]:
    """``[fn(task) for task in tasks]``, in order: inline when ``executor`` is None and
    ``workers <= 1``, else on ``executor`` or a pool of ``workers`` spawned processes (shut
    down, pending work cancelled, if a task raises). ``bar`` advances by ``weight(task)``."""
    pool = as_executor(executor)
    if not tasks:
        return []
    if pool is None and workers <= 1:
        results = []
        for task in tasks:
            results.append(fn(task))
            bar.update(weight(task))
        return results
    own = pool is None
    pool = pool or cf.ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn")
    )
    done: dict[int, Result] = {}
    try:
        futures = {pool.submit(fn, task): i for i, task in enumerate(tasks)}
        for future in cf.as_completed(futures):
            i = futures[future]
            done[i] = future.result()
            bar.update(weight(tasks[i]))
    finally:
        if own:
            pool.shutdown(cancel_futures=True)
    return [done[i] for i in range(len(tasks))]
