"""Run independent units of work (slides to index, export units) inline, in local processes or
on any ``concurrent.futures.Executor`` (a Dask cluster's ``client.get_executor()``), with one
progress bar. Shared by the index builder and the exporter; imports neither torch nor dask.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
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


PARENT_POLL_S = 1.0
STOP_WAIT_S = 10.0  # for a terminated worker to exit
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_with_parent(parent: int) -> None:
    """Pool-worker initializer: end this process when ``parent`` dies (a killed ``index`` or
    ``export`` must not leave workers reading slides). Linux delivers SIGTERM at once
    (``PR_SET_PDEATHSIG``); elsewhere, and for the race before it is set, a daemon thread
    notices the parent change within a second."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="wsi-parent-watch", daemon=True).start()


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
    if pool is not None:
        return _run_on(pool, fn, tasks, bar, weight)
    own = cf.ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=exit_with_parent,
        initargs=(os.getpid(),),
    )
    try:
        return _run_on(own, fn, tasks, bar, weight, spawning=_interrupts_deferred)
    except BaseException:  # Ctrl-C, or a task that failed: stop now, not after running tasks
        _stop(own)
        raise
    finally:
        own.shutdown(cancel_futures=True)


def _run_on(
    pool: cf.Executor,
    fn: Callable[[Task], Result],
    tasks: Sequence[Task],
    bar: tqdm[Any],
    weight: Callable[[Task], int],
    spawning: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> list[Result]:
    done: dict[int, Result] = {}
    with spawning():  # a local pool starts its processes on the first submissions
        futures = {pool.submit(fn, task): i for i, task in enumerate(tasks)}
    for future in cf.as_completed(futures):
        i = futures[future]
        done[i] = future.result()
        bar.update(weight(tasks[i]))
    return [done[i] for i in range(len(tasks))]


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Start worker processes with SIGINT off: a terminal's Ctrl-C reaches every process of
    the group, and workers interrupted while importing printed a traceback each, or left the
    pool waiting forever for them. The parent alone handles Ctrl-C and stops the workers
    (`_stop`).

    SIGINT is *blocked* here, not ignored: children keep the blocked mask across exec (so
    they never see it), while the parent's Ctrl-C stays pending and is raised when this ends.
    Ignoring it lost a Ctrl-C pressed while the tasks were handed over (seconds for a large
    archive). The mask is the calling thread's only: a Ctrl-C that another thread of the
    process takes is noted by a handler and raised here too, never inside a half-started
    worker (which printed 'EOFError: Ran out of input'). Where signals cannot be blocked
    (Windows), it is ignored as before."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    if hasattr(signal, "pthread_sigmask"):
        taken: list[int] = []
        previous = signal.signal(signal.SIGINT, lambda signum, frame: taken.append(signum))
        previous = signal.SIG_DFL if previous is None else previous  # one set outside Python
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)  # a pending one fires
            if taken:
                signal.raise_signal(signal.SIGINT)
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop(pool: cf.ProcessPoolExecutor) -> None:
    """End the pool's processes now: its own shutdown waits for running tasks, and after an
    interrupt it can wait forever for a worker whose shutdown message never went out."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # CPython's pid map
    manager = getattr(pool, "_executor_manager_thread", None)
    for process in processes:
        process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.join(STOP_WAIT_S)
    # the pool's thread sees the ended workers and closes its pipes; left running, it raced
    # the interpreter's exit, which writes to one of them (EBADF printed at exit)
    if manager is not None:
        manager.join(STOP_WAIT_S)
