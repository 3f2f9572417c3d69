"""`RayExecutor`: a ``concurrent.futures.Executor`` whose calls run as Ray tasks, so that the
work this library hands to an executor (slides to index, export units: `wsi_loader.parallel`)
runs on a Ray cluster as it runs on a Dask one (``client.get_executor()``).

Each ``submit`` is one task (one CPU by default, ``ray_remote_args`` to change it); its
future is the task's (``ObjectRef.future()``), so results, exceptions and cancellation are
Ray's. A task whose worker dies is retried by Ray (``max_retries``), which is safe for the
units handed out here: each writes its own output under a temporary name and renames it.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import ray

T = TypeVar("T")


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


class RayExecutor(cf.Executor):
    """Runs each submitted call as a Ray task on the cluster this process is connected to
    (``ray.init`` first; an unconnected process starts a local one, as Ray does)."""

    def __init__(self, ray_remote_args: dict[str, Any] | None = None) -> None:
        self._remote = ray.remote(_call).options(**(ray_remote_args or {"num_cpus": 1}))
        self._pending: dict[int, ray.ObjectRef[Any]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> cf.Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a RayExecutor after shutdown")
            ref = self._remote.remote(fn, args, kwargs)
            future: cf.Future[T] = ref.future()
            self._pending[id(future)] = ref
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: cf.Future[Any]) -> None:
        with self._lock:
            self._pending.pop(id(future), None)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._pending.values())
        if cancel_futures:
            for ref in pending:
                ray.cancel(ref)
        if wait and pending:
            ray.wait(pending, num_returns=len(pending))
