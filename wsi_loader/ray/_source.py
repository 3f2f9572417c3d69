"""`tiles`: the rows of a `SlideIndex` as a ``ray.data.Dataset`` of uint8 NHWC batches.

`TileSource` is a Ray Data datasource. Its read tasks are planned on the driver from the index
alone: each slide's rows in strip order (`wsi_loader.dataset._scan.scan_order`, so that windows
sharing a storage tile are read one after the other by the same process and the tile is
decoded once), cut into runs of whole batches, one run per task, never mixing slides. A task
reads its run batch by batch with the `TileDataset` the driver prepared (options checked, the
slides found, views applied), which travels once through Ray's object store: workers never
open the index files, and a new epoch plans its tasks from the same object.

Each block holds ``batch_size`` rows (the last of a run fewer): ``image`` (N, H, W, 3) uint8,
``slide_id``, ``x``, ``y`` (level-0 top-left), ``level``, ``label`` (-1 when unlabelled),
``ok``, ``substituted`` and ``row`` (the dataset's row); with context scales also
``context_<k>`` (N, size, size, 3) and ``context_inside`` (N, scales, 4). Two string columns
come when ``columns`` names them (``iter_torch_batches`` cannot make tensors of strings):
``split`` (the slide's, "" when none) and ``error`` (why a tile is not ok, "" when it is).
A tile that cannot be read is a row with ``ok = False`` (``on_error="fill"``: its pixels are
the fill value), and the worker that read it appends it to the index's quarantine as a local
read does; a slide that disappears after planning makes its rows not ok and is recorded once
per process.

Shuffling (``shuffle=True``) permutes the tasks and the rows inside each block by
``(seed, epoch)``; for a wider mix use Ray's ``local_shuffle_buffer_size`` or
``random_shuffle``. Per-tile transforms belong in ``map_batches`` (or on the device).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import ray
import ray.data
from ray.data.block import Block, BlockAccessor, BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from wsi_loader.dataset._scan import scan_order
from wsi_loader.dataset._tiles import TileDataset
from wsi_loader.index._table import SlideIndex
from wsi_loader.permutation import key_rng

# every column a block can carry, in this order (``context_<k>`` and ``context_inside``
# follow ``image`` when the dataset reads context tiles)
COLUMNS = (
    "image",
    "slide_id",
    "x",
    "y",
    "level",
    "label",
    "split",
    "ok",
    "error",
    "substituted",
    "row",
)
# strings: on request only, since ``iter_torch_batches`` converts every column to a tensor
TEXT_COLUMNS = ("split", "error")
# batches per read task at least: Ray asks for 200 tasks or more, which on a small index
# makes tasks of one batch, and a task costs about as much as reading a batch (measured:
# 2 CPUs, 6,144 tiles, blocks not split: 1,688 tiles/s with tasks of 2 batches, 1,929 with 4,
# 1,870 with 8; see docs/benchmarks.md#ray-data)
MIN_TASK_BATCHES = 4
# the read tasks Ray asks for when not told (its default parallelism is at least this)
RAY_DEFAULT_BLOCKS = 200
# TileDataset options that have no meaning in a read task (Ray's map_batches transforms)
_REFUSED = ("transform", "batch_transform")


def plan_runs(
    index: SlideIndex,
    batch_size: int,
    tasks: int,
    slides: Sequence[int] | None = None,
    task_batches: int | None = None,
) -> list[npt.NDArray[np.int64]]:
    """The rows of each read task: every slide's rows (of ``slides`` only, when given) in
    strip order, cut into runs of whole batches (about ``len(index) / tasks`` rows, never fewer
    than `MIN_TASK_BATCHES` batches; ``task_batches`` batches when given), slide after slide; a
    run never holds two slides' rows."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = index.slide_starts()
    chosen = range(len(index.slides)) if slides is None else sorted(set(slides))
    total = sum(int(starts[s + 1] - starts[s]) for s in chosen)
    per_task = max(1, math.ceil(total / max(1, tasks)))
    per_task = batch_size * max(MIN_TASK_BATCHES, math.ceil(per_task / batch_size))
    if task_batches is not None:
        per_task = batch_size * task_batches
    runs = []
    for slide_id in chosen:
        if starts[slide_id + 1] == starts[slide_id]:
            continue
        rows = scan_order(index, slide_id)
        runs += [rows[i : i + per_task] for i in range(0, len(rows), per_task)]
    return runs


class TileSource(Datasource):
    """The tiles of one `TileDataset` as a Ray Data datasource (see the module docstring).

    ``slides``: read only these slides' rows (ids of the dataset's index; a model pass's
    slides still to do). ``task_batches``: batches per read task (default: planned from the
    tasks Ray asks for). ``dataset(epoch)`` is the ``ray.data.Dataset`` of one epoch: with
    ``shuffle``, another order for every epoch, drawn from ``(seed, epoch)``; the prepared
    dataset is put in the object store once, when the source is made (Ray must be running or
    is started then).
    """

    def __init__(
        self,
        index: SlideIndex | str | os.PathLike[str] | TileDataset,
        *,
        batch_size: int,
        columns: Sequence[str] | None = None,
        context: Sequence[tuple[float, int]] | None = None,
        stain: Any = None,
        where: Callable[..., Any] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        slides: Sequence[int] | None = None,
        task_batches: int | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        refused = sorted(set(options) & set(_REFUSED))
        if refused:
            raise ValueError(
                f"{', '.join(refused)} cannot be given to wsi_loader.ray.tiles: transform "
                "the batches with Dataset.map_batches (or on the device)"
            )
        if isinstance(index, TileDataset):
            if context is not None or stain is not None or where is not None or options:
                raise ValueError(
                    "context, stain, where and dataset options are the TileDataset's own: "
                    "give them when making it, or pass the index instead"
                )
            dataset = index
        else:
            if where is not None:
                opened = index if isinstance(index, SlideIndex) else SlideIndex.open(index)
                index = opened.view(where=where)
            options.setdefault("decode_threads", 1)  # a read task holds one CPU
            dataset = TileDataset(index, context=context, stain=stain, **options)
        self.tiles = dataset
        self.batch_size = batch_size
        known = self._known_columns(dataset)
        chosen = [c for c in known if c not in TEXT_COLUMNS] if columns is None else list(columns)
        unknown = [c for c in chosen if c not in known]
        if unknown or not chosen:
            raise ValueError(f"columns must be some of {known}, got {list(chosen)}")
        self.columns = chosen
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.slides = None if slides is None else [int(s) for s in slides]
        self.task_batches = task_batches
        self._ref = ray.put(dataset)

    @staticmethod
    def _known_columns(dataset: TileDataset) -> list[str]:
        context = [f"context_{k}" for k in range(len(dataset.context))]
        extra = [*context, "context_inside"] if context else []
        return [COLUMNS[0], *extra, *COLUMNS[1:]]

    def dataset(self, epoch: int = 0, **read_args: Any) -> ray.data.Dataset:
        """The ``ray.data.Dataset`` of epoch ``epoch`` (``read_args`` go to
        ``ray.data.read_datasource``: ``override_num_blocks``, ``num_cpus``,
        ``ray_remote_args``, ...; ``override_num_blocks`` is the number of tasks planned
        unless given; see `remote_options` for ``ray_remote_args``)."""
        source = _epoch_copy(self, int(epoch))
        read_args = remote_options(read_args)
        if read_args.get("override_num_blocks") is None:
            # as many blocks as the tasks plan: asked for more (Ray's default is 200 or more),
            # Ray cuts every block of a task into pieces of a few rows (SplitBlocks), each
            # costing a block's overhead (measured: 1,536 tiles, 6 tasks cut 34 ways)
            read_args["override_num_blocks"] = len(self.runs(RAY_DEFAULT_BLOCKS))
        dataset: ray.data.Dataset = ray.data.read_datasource(source, **read_args)
        return dataset

    def runs(self, parallelism: int) -> list[tuple[int, npt.NDArray[np.int64]]]:
        """The read tasks of this epoch, in the order they are handed to Ray: (the run's
        number in slide-and-strip order, its rows); see `plan_runs`."""
        runs = plan_runs(
            self.tiles.index, self.batch_size, parallelism, self.slides, self.task_batches
        )
        order = np.arange(len(runs))
        if self.shuffle:
            order = key_rng(self.seed, self.epoch).permutation(len(runs))
        return [(k, runs[k]) for k in order.tolist()]

    # -- Datasource --------------------------------------------------------------------------
    def get_name(self) -> str:
        return "Tiles"

    def estimate_inmemory_data_size(self) -> int:
        t = self.tiles.tile_size
        per_row = t * t * 3 + sum(size * size * 3 for _, size in self.tiles.context) + 64
        return len(self.tiles) * per_row

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        per_row = self.estimate_inmemory_data_size() // max(1, len(self.tiles))
        tasks = []
        for k, rows in self.runs(parallelism):
            key = (self.seed, self.epoch, k) if self.shuffle else None
            read = functools.partial(
                _read_run, self._ref, rows, self.batch_size, self.columns, self.epoch, key
            )
            meta = BlockMetadata(
                num_rows=len(rows),
                size_bytes=len(rows) * per_row,
                exec_stats=None,
                input_files=None,
            )
            tasks.append(ReadTask(read, meta, per_task_row_limit=per_task_row_limit))
        return tasks


def _epoch_copy(source: TileSource, epoch: int) -> TileSource:
    """``source`` for another epoch (a shallow copy: the same object in the store)."""
    copy = object.__new__(TileSource)
    copy.__dict__.update(source.__dict__)
    copy.epoch = epoch
    return copy


def _read_run(
    ref: ray.ObjectRef[TileDataset],
    rows: npt.NDArray[np.int64],
    batch_size: int,
    columns: list[str],
    epoch: int,
    key: tuple[int, int, int] | None,
) -> Iterator[Block]:
    """One read task: the run's rows, one block per batch (in a Ray worker)."""
    tiles: TileDataset = ray.get(ref)
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            block = read_block(tiles, chunk, columns, epoch)
            if key is not None:
                shuffled = key_rng(*key, start).permutation(len(chunk))
                block = {name: values[shuffled] for name, values in block.items()}
            yield BlockAccessor.batch_to_block(block)
    finally:
        tiles.reader.close()


def read_block(
    tiles: TileDataset, rows: npt.NDArray[np.int64], columns: list[str], epoch: int
) -> dict[str, npt.NDArray[Any]]:
    """The columns of ``rows`` as numpy arrays, read by ``tiles`` (stain transforms applied,
    drawn from ``epoch``)."""
    result = tiles.read_rows(rows)
    cols = tiles.index.columns
    slide_ids = np.asarray(cols["slide_id"][rows], dtype=np.int64)
    if tiles.stain is not None:  # context tiles as their tile: the same draw per row
        for pixels in (result.pixels, *result.context):
            tiles.stain.apply_numpy(pixels, slide_ids, rows, epoch, result.ok)
    slides = tiles.index.slides
    splits = [s.split or "" for s in slides]
    values: dict[str, Callable[[], npt.NDArray[Any]]] = {
        "image": lambda: result.pixels,
        "slide_id": lambda: slide_ids,
        "x": lambda: np.asarray(cols["l0_x"][rows], dtype=np.int64),
        "y": lambda: np.asarray(cols["l0_y"][rows], dtype=np.int64),
        "level": lambda: np.asarray(cols["level"][rows], dtype=np.int64),
        "label": lambda: np.asarray(tiles.tile_labels(rows), dtype=np.int64),
        "split": lambda: np.array([splits[s] for s in slide_ids.tolist()], dtype=object),
        "ok": lambda: np.asarray(result.ok, dtype=bool),
        "error": lambda: np.array([e or "" for e in result.errors], dtype=object),
        "substituted": lambda: np.asarray(result.substituted, dtype=bool),
        "row": lambda: np.asarray(rows, dtype=np.int64),
        "context_inside": lambda: np.asarray(result.context_inside, dtype=np.int32),
    }
    for k, pixels in enumerate(result.context):
        values[f"context_{k}"] = functools.partial(lambda p: p, pixels)
    return {name: values[name]() for name in columns}


# the read tasks' ray.remote options that ray.data.read_datasource takes as named parameters
# (Ray 2.60 deprecates its ray_remote_args for them; older Rays name fewer)
_REMOTE_OPTIONS = (
    "num_cpus",
    "num_gpus",
    "memory",
    "resources",
    "max_calls",
    "accelerator_type",
    "label_selector",
    "fallback_strategy",
    "runtime_env",
)


def remote_options(read_args: dict[str, Any]) -> dict[str, Any]:
    """``read_args`` with the options in their ``ray_remote_args`` that the installed
    ``ray.data.read_datasource`` names as parameters passed as those (Ray warns that
    ``ray_remote_args`` goes away in Ray 2.64); an option also given by name wins, as in Ray.
    Options Ray names nowhere (retries, a scheduling strategy) stay in ``ray_remote_args``
    while the installed Ray takes it."""
    remote = dict(read_args.get("ray_remote_args") or {})
    named = set(_REMOTE_OPTIONS) & set(inspect.signature(ray.data.read_datasource).parameters)
    out = {key: value for key, value in read_args.items() if key != "ray_remote_args"}
    for key in named & remote.keys():
        out.setdefault(key, remote.pop(key))
    if remote:
        out["ray_remote_args"] = remote
    return out


def tiles(
    index: SlideIndex | str | os.PathLike[str] | TileDataset,
    *,
    batch_size: int,
    columns: Sequence[str] | None = None,
    context: Sequence[tuple[float, int]] | None = None,
    stain: Any = None,
    where: Callable[..., Any] | None = None,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    override_num_blocks: int | None = None,
    ray_remote_args: dict[str, Any] | None = None,
    **options: Any,
) -> ray.data.Dataset:
    """The tiles of ``index`` as a ``ray.data.Dataset`` (see `wsi_loader.ray._source`).

    ``batch_size``: rows per block (what a read task yields at a time); ``columns``: the
    columns to keep (default: all but the strings ``split`` and ``error``); ``context``,
    ``stain`` and ``options`` (``on_error``, ``split``, ``missing_slides``, ``root``,
    ``quarantine``, ...) as for `TileDataset`;
    ``where``: only the rows it keeps (see `SlideIndex.open`). ``shuffle``, ``seed``,
    ``epoch``: the order (see `TileSource`; keep a `TileSource` and call ``dataset(epoch)`` to
    draw a new order each epoch from the same prepared dataset). ``override_num_blocks``
    (about how many read tasks) and ``ray_remote_args`` (their resources, retries) go to
    ``ray.data.read_datasource`` (the resources as its named parameters: `remote_options`).
    """
    source = TileSource(
        index,
        batch_size=batch_size,
        columns=columns,
        context=context,
        stain=stain,
        where=where,
        shuffle=shuffle,
        seed=seed,
        **options,
    )
    return source.dataset(
        epoch, override_num_blocks=override_num_blocks, ray_remote_args=ray_remote_args
    )
