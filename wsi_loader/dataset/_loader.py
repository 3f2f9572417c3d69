"""`make_loader`: a DataLoader that reads whole batches inside its workers.

The DataLoader gets a `BatchSampler` as its sampler and ``batch_size=None``, so each worker call
receives a list of rows and returns one `TileBatch`: one read loop, one buffer, one tensor per
batch through the worker queue, no per-item collate.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # its exit handler must be registered before ours (see below)
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from wsi_loader.config import LoaderConfig, check_keywords, validate
from wsi_loader.dataset._batch import TileBatch
from wsi_loader.dataset._batch_reads import BatchReads
from wsi_loader.dataset._buffers import BufferRing
from wsi_loader.dataset._choice import MAX_WORKERS, ReaderChoice, choose_readers
from wsi_loader.dataset._cores import usable_cores
from wsi_loader.dataset._look_ahead import BatchPlan, LookAhead
from wsi_loader.dataset._samplers import DistributedTileSampler
from wsi_loader.dataset._threaded import read_ahead, reader_copies
from wsi_loader.dataset._tiles import TileDataset
from wsi_loader.dataset._transport import SlotRing
from wsi_loader.dataset._worker_exit import (
    parent_temp_folder,
    sigint_held_for_new_workers,
    start_worker,
)
from wsi_loader.errors import ConfigError, LoaderTimeoutError, LoaderWorkerDiedError
from wsi_loader.index._table import SlideIndex
from wsi_loader.parallel import how_it_ended

log = logging.getLogger(__name__)


# Iterators of ours whose worker processes may still run: persistent workers, or an epoch left
# in the middle by a caller still holding its iterator (a script's or notebook's global).
_RUNNING: weakref.WeakSet[Any] = weakref.WeakSet()


def _shutdown(iterator: Any) -> None:
    """Stop a DataLoader iterator's workers as torch does when the iterator is deleted."""
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        with contextlib.suppress(Exception):  # as in torch's __del__: nothing to tell anyone
            stop()


def _stop_workers_at_exit() -> None:
    """Stop the workers of iterators still alive as the interpreter ends, the way torch does
    when an iterator is deleted (each worker told to stop, then joined). Without it,
    multiprocessing's own exit handler, which runs after ours (atexit is last in, first out),
    kills them with SIGTERM, and each leaves a ``pymp-*`` folder with a socket in the temporary
    directory (torch hands batches over through it), one per worker and run."""
    for iterator in list(_RUNNING):
        _shutdown(iterator)


atexit.register(_stop_workers_at_exit)


def default_workers() -> int:
    """One worker per core the process may use, at most 8."""
    return max(0, min(usable_cores(), MAX_WORKERS))


def _passthrough(batch: Any) -> Any:
    """The batch is already collated by the worker (a `TileBatch`)."""
    return batch


class TileLoader(DataLoader[TileBatch]):
    """The DataLoader `make_loader` returns: ``tile_sampler`` is the per-row sampler inside the
    batch sampler; ``set_epoch`` forwards to it (when it has one)."""

    tile_sampler: Sampler[int] | Iterable[int]
    reading: torch.Tensor | None = None  # see BatchReads.reading
    tiles: TileDataset | None = None
    # what reads the batches (`choose_readers`); with threads, how many batches ahead of the
    # consumer each reader thread reads, and the readers' own copies of the dataset
    readers: ReaderChoice | None = None
    read_ahead: int = 1
    _copies: list[BatchReads] | None = None
    _stopper: weakref.finalize[Any, Any] | None = None
    # worker processes hand batches over through a ring of shared slots (`_transport`); False:
    # through torch's shared memory, one descriptor per batch (the benchmark's baseline)
    use_ring: bool = True
    _ring: SlotRing | None = None
    _fallbacks_before = 0  # of the rings of earlier sets of workers

    def _get_iterator(self) -> Any:
        # where torch starts worker processes (each epoch, or once for persistent workers)
        ring = None
        if self.num_workers and isinstance(self.dataset, BatchReads):
            self._fallbacks_before = self.ring_fallbacks
            ring = self.dataset.open_ring(self.num_workers) if self.use_ring else None
            self.dataset.ring = self._ring = ring
        try:
            with sigint_held_for_new_workers(self.multiprocessing_context):
                iterator = super()._get_iterator()
        finally:
            if ring is not None:
                ring.workers_started()
        if ring is not None:
            iterator._wsi_ring = ring  # type: ignore[attr-defined]  # received from while the iterator lives
        return iterator

    @property
    def ring_fallbacks(self) -> int:
        """Batches that worker processes sent through torch's shared memory because all their
        ring slots held batches the consumer still kept (`wsi_loader.dataset._transport`)."""
        return self._fallbacks_before + (self._ring.fallbacks if self._ring is not None else 0)

    def __iter__(self) -> Iterator[TileBatch]:  # type: ignore[override]
        if self.readers is not None and self.readers.kind == "threads":
            yield from self._read_in_threads(self.readers.threads)
            return
        try:
            # persistent workers are told to start the next epoch here, and torch waits for
            # each to answer: a worker still stuck times out in this call
            iterator = super().__iter__()
        except RuntimeError as exc:
            timed_out = self._timed_out(exc)
            if timed_out is None:
                raise
            raise timed_out from exc
        if self.num_workers:
            _RUNNING.add(iterator)
        if self.num_workers and self.persistent_workers and self._stopper is None:
            # the persistent workers stop when this loader goes. Why not leave it to the
            # iterator's __del__: a loader in a reference cycle is freed by the garbage
            # collector, which first runs the finalizers of its queues; the iterator then
            # tells its workers to stop through a closed queue, waits 5 s for each, and
            # kills them. Held here, the iterator and its queues outlive the loader.
            self._stopper = weakref.finalize(self, _shutdown, iterator)
            self._stopper.atexit = False  # _stop_workers_at_exit does it, in the right order
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except (RuntimeError, OSError, EOFError) as exc:
                failure = self._timed_out(exc) or _worker_died(iterator, exc)
                if failure is None:
                    raise
                raise failure from exc
            yield batch

    def _read_in_threads(self, readers: int) -> Iterator[TileBatch]:
        """The thread path (`wsi_loader.dataset._threaded`): each reader thread reads with its
        own copy of the dataset (made once, kept between epochs like persistent workers), one
        decode thread each unless the dataset says otherwise."""
        if self._copies is None:
            assert isinstance(self.dataset, BatchReads)
            self._copies = reader_copies(self.dataset, readers)
            for copy in self._copies:
                if copy.tiles.decode_threads is None:
                    copy.tiles.decode_threads = 1
        copies = self._copies
        pin = self.pin_memory

        def read(reader: int, plan: BatchPlan) -> TileBatch:
            batch = copies[reader][plan]
            return batch.pin_memory() if pin else batch  # in the reader: off the consumer's time

        plans: Iterable[BatchPlan] = self.sampler
        yield from read_ahead(plans, read, readers, self.read_ahead * readers)

    def _timed_out(self, error: BaseException) -> LoaderTimeoutError | None:
        """torch's timeout (a bare RuntimeError) as `LoaderTimeoutError` naming the slides the
        workers were reading; None for any other error."""
        if (
            not isinstance(error, RuntimeError)
            or "timed out" not in str(error)
            or self.reading is None
            or self.tiles is None
        ):
            return None
        stuck = sorted({int(s) for s in self.reading.tolist() if s >= 0})
        paths = [self.tiles.index.slide_path(s) for s in stuck]
        return LoaderTimeoutError(
            f"no batch within timeout={self.timeout} s; the workers were reading "
            f"{', '.join(paths) if paths else 'no slide (stuck elsewhere)'}",
            seconds=self.timeout,
            slide_ids=stuck,
            paths=paths,
        )

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.tile_sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        if self.tiles is not None:
            self.tiles.set_epoch(epoch)  # for a sampler without one (the batches carry it)


WORKER_END_WAIT_S = 2.0  # for the fork server to report how a worker that just died ended


def _worker_died(iterator: Any, error: BaseException) -> LoaderWorkerDiedError | None:
    """The error of a loop whose worker process died, saying which worker and how it ended;
    None when every worker is alive (the error is about something else).

    Why: a forkserver (or spawned) worker is no child of this process, so torch's SIGCHLD
    handler never says one died: the loop failed with ConnectionResetError (fetching a batch
    the dead worker had queued, through its socket) or, 5 s later, 'DataLoader worker (pid(s)
    N) exited unexpectedly'. A worker killed a moment ago may not be reported yet: when the
    error looks like a dead worker, its end is waited for (bounded)."""
    workers = list(getattr(iterator, "_workers", None) or [])

    def dead() -> list[tuple[int, Any]]:
        return [(i, w) for i, w in enumerate(workers) if w.exitcode not in (None, 0)]

    found = dead()
    text = str(error)
    if (
        not found
        and workers
        and (
            isinstance(error, (ConnectionError, EOFError))
            or "exited unexpectedly" in text
            or "killed by signal" in text
        )
    ):
        multiprocessing.connection.wait([w.sentinel for w in workers], WORKER_END_WAIT_S)
        found = dead()
    if not found:
        return None
    described = "; ".join(f"worker {i} (pid {w.pid}) {how_it_ended(w.exitcode)}" for i, w in found)
    first_id, first = found[0]
    return LoaderWorkerDiedError(
        f"a DataLoader worker process died: {described}. If memory ran short, fewer workers "
        "(num_workers), a smaller batch_size or prefetch_factor need less; the loader's "
        "other workers are stopped",
        worker_id=first_id,
        pid=first.pid,
        exitcode=first.exitcode,
    )


def make_loader(
    data: TileDataset | SlideIndex | str | os.PathLike[str],
    batch_size: int = 64,
    *,
    shuffle: bool | None = None,
    seed: int | None = None,
    sampler: Sampler[int] | Iterable[int] | None = None,
    batches: Iterable[Sequence[int]] | None = None,
    drop_last: bool = False,
    num_workers: int | str | None = "auto",
    pin_memory: bool | None = None,
    prefetch_factor: int = 4,
    prefetch: int = 2,
    persistent_workers: bool = True,
    multiprocessing_context: str | None = None,
    decode: str = "cpu",
    reuse_buffers: bool = True,
    timeout: float = 0,
    **dataset_options: Any,
) -> TileLoader:
    """A DataLoader yielding `TileBatch` objects, with sane defaults.

    ``sampler`` defaults to a `DistributedTileSampler` (sharded across ranks when
    torch.distributed is initialised; ``shuffle``, default True, and ``seed``, default 0, are
    its options, so giving them with your own ``sampler`` is an error); call
    ``loader.set_epoch(e)`` every epoch. ``batches``: the batches to read, in this order,
    instead of ``sampler`` cut into ``batch_size`` pieces (batch ``k`` goes to worker
    ``k % num_workers``: whole-slide passes give each worker its own part of a slide, see
    `wsi_loader.dataset._scan`). Every option is validated (`LoaderConfig`, and
    `DatasetConfig` for the dataset's) and a bad one is a `ConfigError` naming it.
    ``num_workers="auto"`` (the default; ``None`` alike) chooses what reads the batches and
    logs the choice and why (`wsi_loader.dataset._choice`, kept as ``loader.readers``): on a
    few cores, one reader thread per usable core in this process, each with its own copy of
    the dataset and ``prefetch_factor`` batches ahead of the consumer (no worker processes:
    no start-up, nothing sent between processes); otherwise, and when the reads need them
    (``timeout``, ``multiprocessing_context``, Python transforms, stain transforms, slides read
    by OpenSlide), one worker process per usable core (at most 8). A number is used as given
    (``0``: batches read in this thread when asked for). ``pin_memory`` defaults to whether
    CUDA is available. ``decode="device"`` ships single-JPEG-tile reads compressed, for
    `wsi_loader.device.DeviceLoader` to decode (on the GPU when there is one).
    ``reuse_buffers``: each reading process recycles a batch buffer once no tensor over it is
    left in the process that received the batch (saves the page faults of fresh shared memory,
    ~20% of a worker's time); worker processes write into slots of a shared ring made once per
    set of workers and send only the slot number (`wsi_loader.dataset._transport`), and a
    worker whose slots the consumer all still holds sends that batch through torch's shared
    memory instead (counted in ``loader.ring_fallbacks``); batches sent on to other processes
    are copied by torch, so holding or forwarding batches is always safe. ``prefetch``: each
    reading process is told the rows of its next ``prefetch`` batches and requests their bytes
    before decoding the current one (range requests for slides on object storage, read-ahead
    for local files; bounded by the dataset's ``prefetch_mb``; see
    `wsi_loader.dataset._look_ahead`).
    ``timeout`` (seconds; needs workers): no batch for that long raises `LoaderTimeoutError`
    (a `TimeoutError`) naming the slides the workers were reading (a hung network share, a
    file that blocks) instead of waiting forever. Workers start as they do for local slides
    when the index's remote slides are read through libcurl (``s3://`` with keys in the
    environment, ``http(s)://``); for those read through obstore (``gs://``, ``az://``, S3 with
    an instance role) they start with ``forkserver`` where the default is ``fork`` (obstore's
    runtime does not survive fork). Other keyword arguments go to `TileDataset`
    (``transform``, ``batch_transform``, ``split``, ``on_error``, ``context``...):
    ``context=[(2.0, 224)]`` gives every batch ``context[k]``, one NHWC uint8 tensor per scale
    of tiles co-centred with ``images``, read in the same batch read.
    """
    opts: LoaderConfig = validate(
        LoaderConfig,
        {
            "batch_size": batch_size,
            "shuffle": shuffle,
            "seed": seed,
            "drop_last": drop_last,
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "prefetch_factor": prefetch_factor,
            "prefetch": prefetch,
            "persistent_workers": persistent_workers,
            "multiprocessing_context": multiprocessing_context,
            "decode": decode,
            "reuse_buffers": reuse_buffers,
            "timeout": timeout,
        },
    )
    if batches is not None and sampler is not None:
        raise ConfigError("give sampler or batches, not both", key="batches")
    if (sampler is not None or batches is not None) and (
        opts.shuffle is not None or opts.seed is not None
    ):
        raise ConfigError(
            "shuffle and seed are options of the default sampler; with your own sampler, set "
            "them on it",
            key="shuffle" if opts.shuffle is not None else "seed",
        )
    check_keywords("make_loader", dataset_options, [*TileDataset.option_names(), *_OWN_KEYWORDS])
    if dataset_options and isinstance(data, TileDataset):
        raise ConfigError(
            f"dataset options ({', '.join(sorted(dataset_options))}) apply only when "
            "make_loader builds the TileDataset; give them to your TileDataset",
            key=sorted(dataset_options)[0],
        )
    tiles = data if isinstance(data, TileDataset) else TileDataset(data, **dataset_options)
    if opts.decode == "device" and tiles.reader.on_error == "substitute":
        raise ConfigError(
            "decode='device' decodes in the main process, where no other tile can be read in "
            "place of a corrupt one: use on_error='fill' or 'raise', or decode='cpu'",
            key="on_error",
            value="substitute",
        )
    if sampler is None and batches is None:
        sampler = DistributedTileSampler(
            tiles,
            shuffle=True if opts.shuffle is None else opts.shuffle,
            seed=opts.seed or 0,
        )
    context = opts.multiprocessing_context
    if not tiles.reader.fork_safe and context in (None, "fork"):
        if context == "fork":
            raise ConfigError(
                "this index's slides are on object storage read with obstore, whose runtime "
                "does not survive fork() once this process has used it (its threads stay "
                "behind and workers hang): use multiprocessing_context='forkserver' (the "
                "default here) or 'spawn'",
                key="multiprocessing_context",
                value="fork",
            )
        if _start_method() == "fork":
            context = "forkserver"  # the workers start from a process that never used obstore
    batch_size, drop_last, decode = opts.batch_size, opts.drop_last, opts.decode
    prefetch_factor, pin_memory = opts.prefetch_factor, opts.pin_memory
    readers = choose_readers(
        tiles,
        opts.num_workers,
        timeout=opts.timeout,
        multiprocessing_context=opts.multiprocessing_context,
    )
    if not isinstance(opts.num_workers, int):
        log.info(
            "make_loader reads with %s (num_workers='auto': %s)",
            f"{readers.threads} reader threads in this process"
            if readers.kind == "threads"
            else f"{readers.workers} worker processes",
            readers.reason,
        )
    workers = readers.workers
    if opts.timeout and not workers:
        raise ConfigError(
            "timeout needs worker processes (num_workers > 0): a read that hangs in this "
            "process cannot be given up",
            key="timeout",
            value=opts.timeout,
        )
    if workers:
        _check_sendable(tiles, context or _start_method())
    reading = None
    if workers and opts.timeout:
        reading = torch.full((workers,), -1, dtype=torch.int64)
        reading.share_memory_()  # type: ignore[no-untyped-call]
    loader = TileLoader(
        BatchReads(
            tiles,
            encoded=decode == "device",
            # enough for the batches queued per worker, the one in use and one being released
            # (each batch is one buffer for its tiles and one per context scale)
            buffers=(
                BufferRing((prefetch_factor + 4) * (1 + len(tiles.context)))
                if reuse_buffers
                else None
            ),
            reading=reading,
            batch_size=batch_size,
        ),
        batch_size=None,
        sampler=LookAhead(
            batches if batches is not None else BatchSampler(sampler or [], batch_size, drop_last),
            max(1, workers, readers.threads),  # each reader is told its own next batches
            opts.prefetch,
            sampler,
        ),
        num_workers=workers,
        collate_fn=_passthrough,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        prefetch_factor=prefetch_factor if workers else None,
        persistent_workers=persistent_workers and workers > 0,
        multiprocessing_context=context if workers else None,
        timeout=opts.timeout if workers else 0,
        worker_init_fn=partial(start_worker, temp_folder=parent_temp_folder()) if workers else None,
    )
    loader.tile_sampler = sampler if sampler is not None else []
    loader.reading, loader.tiles = reading, tiles
    loader.readers, loader.read_ahead = readers, prefetch_factor
    return loader


# make_loader's own keywords, suggested for a misspelt one (batch_sise) among the dataset's
_OWN_KEYWORDS = [
    name
    for name in inspect.signature(make_loader).parameters
    if name not in ("data", "dataset_options")
]


def _start_method() -> str:
    """The start method workers will get by default, without fixing it as
    ``multiprocessing.get_start_method()`` does (a later ``set_start_method`` would fail)."""
    return (
        multiprocessing.get_start_method(allow_none=True)
        or (
            multiprocessing.get_all_start_methods()[0]  # the first is the default
        )
    )


def _check_sendable(tiles: TileDataset, context: str) -> None:
    """Spawned and forkserver workers receive the dataset pickled: say which part cannot be
    (a lambda or a notebook cell's function as ``transform``) before any worker starts,
    instead of torch's PicklingError from inside the first iteration."""
    if context == "fork":
        return
    try:
        ForkingPickler.dumps(tiles)
    except Exception as exc:  # pickling raises PicklingError, AttributeError, TypeError...
        parts = [
            name
            for name in ("transform", "batch_transform")
            if getattr(tiles, name) is not None and not _pickles(getattr(tiles, name))
        ]
        culprit = " and ".join(parts) if parts else "the dataset"
        raise ConfigError(
            f"the dataset cannot be sent to {context!r} workers ({culprit}: "
            f"{type(exc).__name__}: {exc}); those workers receive it pickled, and a lambda or "
            "a function defined in a notebook cell cannot be: make it a module-level function "
            "of an importable module (or a picklable callable object), or use "
            "num_workers=0" + (" or multiprocessing_context='fork'" if _can_fork(tiles) else ""),
            key="multiprocessing_context",
            value=context,
        ) from exc


def _pickles(value: object) -> bool:
    try:
        ForkingPickler.dumps(value)
    except Exception:  # any failure means it cannot be sent
        return False
    return True


def _can_fork(tiles: TileDataset) -> bool:
    """Whether fork is an option to suggest (not for obstore's remote slides; see above)."""
    return "fork" in multiprocessing.get_all_start_methods() and tiles.reader.fork_safe
