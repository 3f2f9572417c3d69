"""A spawned DataLoader worker waits for its result queue to drain before the interpreter ends.

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
import threading
import time

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
