"""How DataLoader workers end cleanly: a spawned worker waits for its result queue to drain
before the interpreter ends, workers keep their temporary files in the parent's folder, and
they leave their parent's process group, so only their parent ends them.

Why: a multiprocessing queue hands each result to a daemon "feeder" thread, which pickles it and
then drops the last reference, so the batch's tensors are freed in that thread. torch releases
the GIL while freeing a tensor. When the worker is told to stop, torch cancels the join of that
thread and the spawned process goes on to finalise the interpreter; a daemon thread that wants
the GIL back during finalisation is ended by ``pthread_exit``, whose unwinding through torch's
C++ frames calls ``std::terminate``: the worker dies of SIGABRT ("terminate called without an
active exception") and the DataLoader reports it (pytorch/pytorch#38228). Seen here in about
one in ten shutdowns of a spawned loader with batches in flight.

atexit handlers run before finalisation starts, so joining the feeder threads there (bounded,
well inside the 5 s torch gives a stopping worker) lets them finish freeing what they hold.
Forked workers leave through ``os._exit`` and never finalise; the main process is not touched.
Importing this module registers the handler once per process.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import threading
import time
from collections.abc import Iterator

# torch seeds numpy's global generator in every new worker, importing numpy.random there when
# the parent has not (~20 ms of a forked worker's start): imported once, here, instead
import numpy.random  # noqa: F401
from torch.utils.data import get_worker_info

FEEDER_THREAD_NAME = "QueueFeederThread"  # what multiprocessing.queues names the thread
JOIN_TIMEOUT_S = 3.0


def let_queue_feeders_finish(timeout: float = JOIN_TIMEOUT_S) -> None:
    """In a DataLoader worker, wait up to ``timeout`` seconds in all for the queue feeder
    threads to end (the worker loop closes its result queue when told to stop)."""
    if get_worker_info() is None:
        return
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name == FEEDER_THREAD_NAME and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(let_queue_feeders_finish)


def parent_temp_folder() -> str:
    """This process's multiprocessing temporary folder (created now if need be; removed when
    this process ends), for its DataLoader workers to share (`start_worker`)."""
    return multiprocessing.util.get_temp_dir()


def use_parent_temp_folder(folder: str | None) -> None:
    """In a DataLoader worker: put the worker's multiprocessing temporary files (the socket
    through which torch hands each batch's storage to the parent) in the parent's folder.

    Why: a worker that creates its own ``pymp-*`` folder removes it only when it ends
    normally; one ended by SIGTERM (multiprocessing's exit handler, torch's shutdown after its
    5 s join, a loader collected as garbage) leaves it behind, one folder per worker and run.
    The parent's folder goes when the parent ends, whatever happened to its workers. A forked
    worker already shares it (inherited); a spawned one learns it here, before its first
    batch is sent. A worker that made its own folder already keeps it."""
    if folder is None or get_worker_info() is None:
        return
    # multiprocessing.util.get_temp_dir keeps the folder in the process's _config
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    if config.get("tempdir") is None and os.path.isdir(folder):
        config["tempdir"] = folder


@contextlib.contextmanager
def sigint_held_for_new_workers(
    context: str | multiprocessing.context.BaseContext | None = None,
) -> Iterator[None]:
    """While this thread starts worker processes (of ``context``, the DataLoader's
    ``multiprocessing_context``; None: the default one), SIGINT is held for them: blocked
    (forked workers inherit the mask, spawned ones keep it across exec) until each leaves the
    group (`start_worker`). Why: a spawned worker imports torch for a second or two before it
    can leave the group, and an interrupt in that time ended it. For this process the
    interrupt is held, not lost: one sent to this thread waits in the mask, and one that
    another thread of the process took (the mask is per thread) is noted by a handler and
    raised again when the start is over (it used to be ignored process-wide: dropped). Only
    around the start (milliseconds): a held Ctrl-C must not wait on the workers' work.

    For a spawn or forkserver context, multiprocessing's resource tracker is started first:
    its start (by the first queue torch makes) unblocks SIGINT in the starting thread, and the
    first spawned workers of a process then started with SIGINT open."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    _start_resource_tracker(context)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = None
    caught: list[int] = []
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGINT)  # None: not set from Python, left alone
        if handler is not None:
            signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one held for this thread: now
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
            if caught:
                signal.raise_signal(signal.SIGINT)


def _start_resource_tracker(
    context: str | multiprocessing.context.BaseContext | None,
) -> None:
    """Start multiprocessing's resource tracker now, where workers of ``context`` would start
    it (anything but fork registers its queues' semaphores with it); a no-op once running."""
    if isinstance(context, multiprocessing.context.BaseContext):
        method = context.get_start_method()
    else:
        method = context or multiprocessing.get_start_method()
    if method != "fork":
        multiprocessing.resource_tracker.ensure_running()


def start_worker(worker_id: int, temp_folder: str | None = None) -> None:
    """`make_loader`'s ``worker_init_fn`` (``temp_folder`` bound to `parent_temp_folder`):
    what a worker sets up once, before its first batch."""
    use_parent_temp_folder(temp_folder)
    leave_parent_process_group()
    exit_with_parent()


def exit_with_parent() -> None:
    """In a new worker (`start_worker`): end it as soon as the process that started it ends.

    Why: torch's watchdog ends a worker when its parent process id changes. A forkserver
    worker's parent is the fork server, which never changes, and the fork server lives as long
    as any process holds its lifeline, which multiprocessing hands to every process it forks:
    after kill -9 of a training script, the fork server and its workers stayed alive for good
    (~380 MB each). A spawned worker noticed within 5 s, then could wait forever at exit for
    its queue's feeder thread to write into a pipe nobody reads. multiprocessing gives every
    child a sentinel of its starter (a pipe whose other end only that process holds, at EOF
    once it is gone): a daemon thread waits on it and ends the worker at once (exit status
    1; there is nobody left to hand a batch to). Once its workers are gone the fork server
    ends by itself. Forked workers share the sentinel with their siblings, which keeps it
    open until they are all gone: torch's watchdog ends those."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if not isinstance(sentinel, int):
        return

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="wsi-parent-watch", daemon=True).start()


def leave_parent_process_group() -> None:
    """In a new worker (`start_worker`): it becomes a process group of its own and ignores
    SIGINT.

    Why: a signal for the whole group reached the workers too. A notebook's interrupt button
    (ipykernel signals its process group) or Ctrl-C in IPython ended them with SIGINT (torch's
    worker loop returns on KeyboardInterrupt), and the same loader's next epoch failed with
    "DataLoader worker (pid(s) ...) exited unexpectedly". And at shutdown ipykernel sends
    SIGTERM to every child in its group and waits until none is left; a dead worker that
    nobody reaps is still listed, so the kernel waited ~30 s and was then killed by its front
    end, before any exit handler ran (the temporary folder stayed behind). A child in a group
    of its own is left alone (ipykernel's rule). Only its parent ends it: torch when the
    iterator goes, `loader._stop_workers_at_exit` at exit, and torch's watchdog in the worker
    (within 5 s) if the parent dies. A SIGINT held while the worker started
    (`sigint_held_for_new_workers`) was meant for the parent and is dropped."""
    if hasattr(os, "setpgid"):
        with contextlib.suppress(OSError):  # already a group or session leader
            os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # drops a pending one too
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
