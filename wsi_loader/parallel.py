"""Run independent units of work (slides to index, export units) inline, in local processes or
on any ``concurrent.futures.Executor`` (a Dask cluster's ``client.get_executor()``), with one
progress bar. Shared by the index builder and the exporter; imports neither torch nor dask.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import functools
import multiprocessing
import multiprocessing.sharedctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple, TypeVar

from tqdm import tqdm

from wsi_loader.errors import ConfigError

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
TIMEOUT_POLL_S = 0.5  # how often the parent looks for a task past its time limit
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


class GivenUp(NamedTuple):
    """Why `run_all` gave a task up: ``timeout`` (not done after ``detail`` seconds) or
    ``died`` (its worker process ended under it: ``detail`` says how)."""

    kind: Literal["timeout", "died"]
    detail: str


def refuse_time_limit_with_executor(key: str, seconds: float, executor: object | None) -> None:
    """A time limit per task needs this machine's worker processes (`run_all` ends a stuck
    one); with an executor it is a `ConfigError`."""
    if seconds and executor is not None:
        raise ConfigError(
            f"{key} needs this machine's worker processes, not an executor: a cluster has its "
            "own limits (e.g. dask's distributed.scheduler.worker-ttl)",
            key=key,
            value=seconds,
        )


def run_all(
    fn: Callable[[Task], Result],
    tasks: Sequence[Task],
    workers: int,
    executor: Any,
    bar: tqdm[Any],
    weight: Callable[[Task], int] = lambda task: 1,
    *,
    given_up: Callable[[Task, GivenUp], Result],
    timeout: float | None = None,
) -> list[Result]:
    """``[fn(task) for task in tasks]``, in order: inline when ``executor`` is None and
    ``workers <= 1``, else on ``executor`` or a pool of ``workers`` spawned processes (shut
    down, pending work cancelled, if a task raises). ``bar`` advances by ``weight(task)``.

    The local pool survives its tasks: a task whose worker process dies under it (killed by
    the out-of-memory killer, a crash in a library) has the result
    ``given_up(task, GivenUp("died", how))``, and the tasks not done go on in a fresh pool.
    With ``timeout`` (seconds), tasks run in worker processes even for one worker, and a
    task still running after that long is given up the same way (``"timeout"``): the
    workers are ended (a stuck process cannot be told to stop its task) and started again for
    the tasks not done (those that were running start over)."""
    pool = as_executor(executor)
    if not tasks:
        return []
    if timeout is not None and pool is not None:
        raise ValueError(
            "a time limit per task needs this machine's worker processes, not an executor "
            "(a cluster has its own: e.g. dask's distributed.scheduler.worker-ttl)"
        )
    if pool is None and workers <= 1 and timeout is None:
        results = []
        for task in tasks:
            results.append(fn(task))
            bar.update(weight(task))
        return results
    if pool is not None:
        return _run_on(pool, fn, tasks, bar, weight)
    return _run_guarded(fn, tasks, max(1, workers), bar, weight, timeout, given_up)


def _local_pool(
    workers: int,
    initializer: Callable[..., None] = exit_with_parent,
    initargs: tuple[Any, ...] = (),
) -> cf.ProcessPoolExecutor:
    return cf.ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=initializer,
        initargs=(os.getpid(), *initargs),
    )


class _Began:
    """In a worker process of a guarded run (set by the pool's initializer): a slot per task
    shared with the parent, saying when a worker began it (CLOCK_MONOTONIC seconds, one clock
    for every process of the machine; 0 = not begun) and which process did."""

    at: Any = None
    by: Any = None


def _start_guarded_worker(parent: int, at: Any, by: Any) -> None:
    exit_with_parent(parent)
    _Began.at, _Began.by = at, by


def _guarded_call(fn: Callable[[Task], Result], slot: int, task: Task) -> Result:
    _Began.by[slot] = os.getpid()
    _Began.at[slot] = time.monotonic()
    return fn(task)


def how_it_ended(exitcode: int | None) -> str:
    """How a process ended, from its ``exitcode`` as `multiprocessing` gives it."""
    if exitcode is None:  # (a process the pool started and ended between two polls)
        return "it ended abruptly"
    if exitcode >= 0:
        return f"exit status {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    oom = ", as the kernel's out-of-memory killer does" if -exitcode == signal.SIGKILL else ""
    return f"killed by {name}{oom}"


MAX_FRUITLESS = 2  # pools in a row that may break with no task done or given up
IN_FLIGHT_PER_WORKER = 2


def _run_guarded(
    fn: Callable[[Task], Result],
    tasks: Sequence[Task],
    workers: int,
    bar: tqdm[Any],
    weight: Callable[[Task], int],
    timeout: float | None,
    given_up: Callable[[Task, GivenUp], Result],
) -> list[Result]:
    """`run_all` on a pool that survives its tasks (its doc). A task's time counts from when
    a worker begins it, not from when it was handed over, so tasks queued behind a stuck one
    are not given up with it. When a worker dies the executor ends the others (SIGTERM), so
    the task of the worker that ended otherwise is the one given up; when none did (a worker
    killed by a SIGTERM from outside), the tasks that were running are retried one at a time,
    alone in a pool, where a death names its task."""
    began_at = multiprocessing.sharedctypes.RawArray(ctypes.c_double, len(tasks))
    began_by = multiprocessing.sharedctypes.RawArray(ctypes.c_long, len(tasks))
    done: dict[int, Result] = {}
    suspects: list[int] = []  # tasks running when a pool broke with no culprit

    def give_up(i: int, why: GivenUp) -> None:
        done[i] = given_up(tasks[i], why)
        bar.update(weight(tasks[i]))

    fruitless = 0
    while len(done) < len(tasks):
        before = len(done)
        alone = suspects[0] if suspects else None
        todo = [alone] if alone is not None else [i for i in range(len(tasks)) if i not in done]
        pool = _local_pool(
            1 if alone is not None else workers, _start_guarded_worker, (began_at, began_by)
        )
        processes: dict[int, Any] = {}
        waiting = collections.deque(todo)
        futures: dict[cf.Future[Result], int] = {}
        limit = IN_FLIGHT_PER_WORKER * (1 if alone is not None else workers)
        try:
            _hand_over(pool, fn, tasks, waiting, futures, limit)
            late: list[int] = []
            broken: BaseException | None = None
            while futures and not late and broken is None:
                finished, _ = cf.wait(futures, TIMEOUT_POLL_S, cf.FIRST_COMPLETED)
                processes.update(getattr(pool, "_processes", None) or {})  # CPython's pid map
                for future in finished:
                    if isinstance(future.exception(), BrokenProcessPool):
                        broken = future.exception()
                        continue
                    i = futures.pop(future)
                    done[i] = future.result()
                    bar.update(weight(tasks[i]))
                if broken is None:
                    _hand_over(pool, fn, tasks, waiting, futures, limit)
                now = time.monotonic()
                late = [
                    i
                    for future, i in futures.items()
                    if timeout is not None
                    and began_at[i]
                    and now - began_at[i] > timeout
                    and not future.done()
                ]
            if late or broken is not None:
                running = [i for i in futures.values() if began_at[i]]
                _stop(pool)  # the tasks not done start over in a new pool
                for i in late:
                    give_up(i, GivenUp("timeout", f"{timeout:g}"))
                if broken is not None:
                    exits = {pid: process.exitcode for pid, process in processes.items()}
                    for i in (i for i in running if i not in done):
                        code = exits.get(began_by[i])
                        if code not in (None, -signal.SIGTERM) or i == alone:
                            give_up(i, GivenUp("died", how_it_ended(code)))
                        elif i not in suspects:
                            suspects.append(i)
                    fruitless = fruitless + 1 if len(done) == before else 0
                    if fruitless >= MAX_FRUITLESS:  # e.g. workers that die as they start
                        raise broken
                for i in futures.values():
                    began_at[i], began_by[i] = 0.0, 0
            if alone is not None and alone in done:
                suspects.remove(alone)
        except BaseException:
            _stop(pool)
            raise
        finally:
            pool.shutdown(cancel_futures=True)
    return [done[i] for i in range(len(tasks))]


def _hand_over(
    pool: cf.Executor,
    fn: Callable[[Task], Result],
    tasks: Sequence[Task],
    waiting: collections.deque[int],
    futures: dict[cf.Future[Result], int],
    limit: int,
) -> None:
    """Submit waiting tasks until ``limit`` are in flight: a few per worker, not all, so what
    is polled stays small however many tasks there are, and a restart has little to cancel."""
    with _interrupts_deferred():
        while waiting and len(futures) < limit:
            i = waiting.popleft()
            futures[pool.submit(functools.partial(_guarded_call, fn, i, tasks[i]))] = i


def _run_on(
    pool: cf.Executor,
    fn: Callable[[Task], Result],
    tasks: Sequence[Task],
    bar: tqdm[Any],
    weight: Callable[[Task], int],
) -> list[Result]:
    done: dict[int, Result] = {}
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
