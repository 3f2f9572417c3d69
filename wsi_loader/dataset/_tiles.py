"""`TileDataset`: a torch Dataset over the rows of a `SlideIndex`.

Handles are opened lazily in the process that reads (a per-process `HandlePool`), so the same
dataset object works with ``num_workers=0``, forked and spawned DataLoader workers without a
``worker_init_fn``; it pickles without handles or tile data. Per-tile state lives only in the
index's memory-mapped numpy columns, so worker memory stays flat in the index size.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from wsi_loader.config import DatasetConfig, validate
from wsi_loader.dataset._batch import TileBatch
from wsi_loader.dataset._buffers import BufferRing, lease, release
from wsi_loader.dataset._context import check_context, recorded_context
from wsi_loader.dataset._cores import FreeCores, threads_per_process
from wsi_loader.dataset._failures import ReadResult
from wsi_loader.dataset._reading import TileReader
from wsi_loader.dataset._transport import BatchBuffers, SlotRing
from wsi_loader.dataset._worker_exit import let_queue_feeders_finish  # noqa: F401 (registers it)
from wsi_loader.errors import ConfigError
from wsi_loader.index._health import require_slides
from wsi_loader.index._table import SlideIndex
from wsi_loader.slides._pool import HandlePool
from wsi_loader.stain._build import as_stain

log = logging.getLogger(__name__)

Sample = dict[str, Any]
Transform = Callable[[torch.Tensor], torch.Tensor]
BatchTransform = Callable[[TileBatch], TileBatch]


def _check_callable(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise ConfigError(
            f"invalid value {value!r} for {name!r}: must be callable or None", key=name, value=value
        )


def open_for_reading(
    index: SlideIndex | str | os.PathLike[str], options: DatasetConfig
) -> SlideIndex:
    """The index view a dataset reads: ``root``, ``split`` and ``exclude_quarantined`` applied
    (to an opened `SlideIndex` too), missing slides checked (``missing_slides``), and slides
    without a label kept, dropped or refused (``unlabelled``)."""
    if isinstance(index, SlideIndex):
        index = index.view(
            root=options.root,
            exclude_quarantined=options.exclude_quarantined,
            split=options.split,
            quarantine=options.quarantine,
        )
    else:
        index = SlideIndex.open(
            index,
            root=options.root,
            exclude_quarantined=options.exclude_quarantined,
            split=options.split,
            quarantine=options.quarantine,
        )
    index = require_slides(index, options.missing_slides)
    if options.unlabelled != "keep" and index.labels_from_annotations:
        unlabelled_rows = index.tile_labels() < 0
        if unlabelled_rows.any() and options.unlabelled == "raise":
            raise ConfigError(
                f"{int(unlabelled_rows.sum())} of {len(index)} tiles have no annotated class "
                "(no class covers min_coverage of them, and no background label); index with "
                "--background-label NAME, or pass unlabelled='drop' to leave them out",
                key="unlabelled",
                value="raise",
            )
        return index.select(~unlabelled_rows)
    if options.unlabelled != "keep":
        labels = index.slide_labels()
        rows_per_slide = np.diff(index.slide_starts())
        unlabelled = np.flatnonzero((labels < 0) & (rows_per_slide > 0)).tolist()
        if unlabelled and options.unlabelled == "raise":
            names = ", ".join(index.slides[i].path for i in unlabelled[:5])
            raise ConfigError(
                f"{len(unlabelled)} slides with {int(rows_per_slide[unlabelled].sum())} tiles "
                f"have no label ({names}); give labels when indexing (--labels), or pass "
                "unlabelled='drop' to leave their tiles out",
                key="unlabelled",
                value="raise",
            )
        index = index.view(drop_slides=unlabelled)
    return index


def chw(pixels: np.ndarray) -> torch.Tensor:
    """A uint8 (3, H, W) view of an (H, W, 3) tile, without a copy: what ``transform`` gets in
    batch reads, whose result is written back into the NHWC batch (per-item samples are
    `channel_planes` instead)."""
    return torch.from_numpy(pixels).permute(2, 0, 1)


def channel_planes(pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The (N, H, W, 3) tiles of a read as (N, 3, H, W), laid out plane by plane (into
    ``out`` when given), so that each per-item image is contiguous and the default collate
    stacks them with a plain copy instead of a transposing one. OpenCV splits the channels
    with SIMD, several times faster than numpy's or torch's transposing copy
    (benchmarks/README.md, "Per-item images")."""
    import cv2  # here: only per-item reads need it; batch-reading workers start without it

    n, h, w, channels = pixels.shape
    planes = np.empty((n, channels, h, w), dtype=np.uint8) if out is None else out
    for tile, tile_planes in zip(pixels, planes, strict=True):
        cv2.split(tile, list(tile_planes))
    return planes


class TileDataset(Dataset[Sample]):
    """One sample per index row.

    ``ds[row]`` is a dict: ``image`` (uint8 ``(3, H, W)`` RGB), ``label`` (label id, -1 when
    unlabelled; names in ``label_names``: the slide's label, or the tile's annotated class
    for an index built with ``label_from="annotations"``), ``slide_label`` (names in
    ``slide_label_names``), ``ok`` (False when the read failed), ``substituted``, ``row``,
    ``slide_id`` and ``x``, ``y`` (level-0 top-left); for an annotated index also
    ``coverage`` (float32, the share of the tile each class of ``index.classes`` covers).

    ``context=[(mpp, size), ...]`` (default: the index's ``index --context``; ``[]``: none)
    adds co-centred context tiles: ``context`` (a list of uint8 ``(3, size, size)``, one per
    scale) and ``context_inside`` (``(scales, 4)``: the part of each on the slide, x0, y0,
    x1, y1; the rest is ``fill_value``). Each scale is read from the coarsest level at least
    as fine as its MPP, in the same batch read as the tiles (see `wsi_loader.dataset._context`
    for the rules). A row whose context tile fails fails as a whole (``on_error`` applies).
    ``transform`` applies to the main tile only: augment all scales alike in
    ``batch_transform`` or on the device.

    ``transform`` runs per tile in the process that reads (a DataLoader worker): it gets the
    uint8 ``(3, H, W)`` image tensor. For ``ds[row]`` it may return anything (the sample's
    ``image``); in batches (`read_batch`, `make_loader`) it must return a uint8 ``(3, H, W)``
    tensor of the same shape (flips, rotations, colour jitter), written back into the batch.
    ``batch_transform`` runs on each `TileBatch` in the process that reads and returns a
    `TileBatch` (any image shape or dtype; batch buffers are then not reused).
    ``stain``: stain transforms of `wsi_loader.stain` (`Normalize`, `HEDJitter`, ...; one or a
    list), applied to each batch in the process that reads (numpy, before ``transform``),
    bound to this index; random ones draw from (seed, epoch, row): make_loader's batches carry
    their sampler's epoch, ``ds[row]`` reads use `set_epoch`'s.

    Options (validated like the YAML ``dataset`` section, `DatasetConfig`; a wrong type or
    range is a `ConfigError` naming the option): ``split`` reads one split; ``missing_slides``
    ("raise" or "exclude") decides what a slide that cannot be read at start does;
    ``unlabelled`` ("keep", "drop", "raise") what tiles of unlabelled slides do.

    ``max_open_slides``: files open per process (LRU); ``layout_cache_mb``: parsed layouts
    that raw-read slides keep when closed, so reopening them is cheap (see `HandlePool`).
    Slides on object storage (URLs): ``prefetch_mb`` bounds the bytes each process fetches
    ahead of its reads and keeps for later ones (least recently used out);
    ``remote_cache_dir`` / ``remote_cache_gb`` hold local copies of the remote slides only
    OpenSlide reads (see `wsi_loader.slides.storage._sources`); ``remote_timeout_s``: the
    longest one request may take (a store that stopped answering fails reads as transient
    errors, with one WARNING).
    ``decode_threads``: threads that read and decode the tiles of one batch read (`read_batch`,
    ``__getitems__``; see `TileReader.read`). ``None`` divides the usable cores among the
    reading processes: all of them with ``num_workers=0``, one each with one worker per core;
    fewer while other processes keep cores busy (measured, see `FreeCores`).

    Failed reads are appended to the index's quarantine, or to the file ``quarantine``
    names (an index on a read-only mount); ``exclude_quarantined`` reads the same file. When
    it cannot be written, each process says so once and reading goes on: failures are still
    in the batches' ``ok`` and in `failures`.
    """

    def __init__(
        self,
        index: SlideIndex | str | os.PathLike[str],
        *,
        on_error: str = "fill",
        retries: int = 2,
        fill_value: int = 255,
        transform: Transform | None = None,
        batch_transform: BatchTransform | None = None,
        max_open_slides: int = 16,
        openslide_cache_mb: int = 64,
        layout_cache_mb: int = 64,
        prefetch_mb: int = 256,
        remote_cache_dir: str = "~/.cache/wsi_loader/slides",
        remote_cache_gb: float = 100,
        remote_timeout_s: float = 30,
        exclude_quarantined: bool = False,
        split: str | None = None,
        missing_slides: str = "raise",
        unlabelled: str = "keep",
        root: str | None = None,
        backend: str | None = None,
        record_failures: bool = True,
        decode_threads: int | None = None,
        quarantine: str | os.PathLike[str] | None = None,
        context: Sequence[tuple[float, int]] | None = None,
        stain: Any = None,
    ) -> None:
        _check_callable("transform", transform)
        stain_steps = as_stain(stain)
        _check_callable("batch_transform", batch_transform)
        options: DatasetConfig = validate(
            DatasetConfig,
            {
                "on_error": on_error,
                "retries": retries,
                "fill_value": fill_value,
                "max_open_slides": max_open_slides,
                "openslide_cache_mb": openslide_cache_mb,
                "layout_cache_mb": layout_cache_mb,
                "prefetch_mb": prefetch_mb,
                "remote_cache_dir": remote_cache_dir,
                "remote_cache_gb": remote_cache_gb,
                "remote_timeout_s": remote_timeout_s,
                "exclude_quarantined": exclude_quarantined,
                "split": split,
                "missing_slides": missing_slides,
                "unlabelled": unlabelled,
                "root": root,
                "backend": backend,
                "record_failures": record_failures,
                "decode_threads": decode_threads,
                "quarantine": None if quarantine is None else os.fspath(quarantine),
                "context": None if context is None else list(context),
            },
        )
        self.options = options
        self.decode_threads = options.decode_threads
        self.free_cores = FreeCores()
        index = open_for_reading(index, options)
        self.index = index
        self.transform = transform
        self.batch_transform = batch_transform
        self.reader = TileReader(
            index,
            on_error=options.on_error,
            retries=options.retries,
            fill_value=options.fill_value,
            pool=HandlePool(
                options.max_open_slides,
                options.openslide_cache_mb * 2**20,
                options.layout_cache_mb * 2**20,
                prefetch_bytes=options.prefetch_mb * 2**20,
                remote_cache_dir=options.remote_cache_dir,
                remote_cache_bytes=int(options.remote_cache_gb * 2**30),
                remote_timeout_s=options.remote_timeout_s,
            ),
            backend=options.backend,
            record_failures=options.record_failures,
            context=self._context_scales(index, options),
        )
        self.slide_labels = index.slide_labels()
        self.label_names = index.label_names
        self.slide_label_names = index.slide_label_names
        self.stain = None if stain_steps is None else stain_steps.bind(index)
        self._said_encoded = False
        # per-item reads (``ds[row]``, ``__getitems__``): the tiles as read and as handed out
        self.item_buffers = BufferRing(capacity=4)
        self.epoch = 0  # of the random stain transforms in per-item reads (set_epoch)

    def set_epoch(self, epoch: int) -> None:
        """The epoch random stain transforms draw from in ``ds[row]`` reads (make_loader's
        batches carry their sampler's epoch instead)."""
        self.epoch = int(epoch)

    @staticmethod
    def option_names() -> list[str]:
        """The keyword options of `TileDataset` (what `make_loader` and `SlideBagDataset` pass
        on to it)."""
        names = inspect.signature(TileDataset.__init__).parameters
        return [name for name in names if name not in ("self", "index")]

    @staticmethod
    def _context_scales(index: SlideIndex, options: DatasetConfig) -> list[tuple[float, int]]:
        """The context scales read: the option's, else the index's default (``index
        --context``); refused when a slide of the index cannot serve them."""
        scales = options.context if options.context is not None else recorded_context(index)
        check_context(index, scales)
        return list(scales)

    @property
    def context(self) -> list[tuple[float, int]]:
        """The context scales ``(mpp, size)`` read beside each tile (none: ``[]``)."""
        return self.reader.context

    @classmethod
    def from_config(
        cls, index: SlideIndex | str | os.PathLike[str], config: DatasetConfig, **kwargs: Any
    ) -> TileDataset:
        """A dataset with the options of ``config``; ``kwargs`` override them."""
        return cls(index, **{**config.model_dump(), **kwargs})

    @property
    def tile_size(self) -> int:
        return self.reader.tile_size

    @property
    def failures(self) -> list[dict[str, Any]]:
        """Failures seen by this process (every process also appends them to the quarantine)."""
        return self.reader.failures

    def __len__(self) -> int:
        return len(self.index)

    def threads_here(self) -> int:
        """Decode threads for a batch read in this process (see ``decode_threads``): by
        default this process's share of the usable cores, fewer while other processes keep
        some of them busy (`FreeCores`)."""
        if self.decode_threads is not None:
            return self.decode_threads
        worker = get_worker_info()
        return self.free_cores(threads_per_process(worker.num_workers if worker else 1))

    def tile_labels(self, rows: np.ndarray) -> np.ndarray:
        """Label ids of ``rows`` (see `SlideIndex.tile_labels`), without rebuilding the slide
        label table per call."""
        if self.index.labels_from_annotations:
            return np.asarray(self.index.columns["tile_label"][rows], dtype=np.int64)
        return np.asarray(self.slide_labels[self.index.columns["slide_id"][rows]], np.int64)

    def read_rows(
        self,
        rows: np.ndarray,
        out: np.ndarray | None = None,
        encoded: bool = False,
        ahead: Sequence[int] | None = None,
        context_out: Sequence[np.ndarray] | None = None,
    ) -> ReadResult:
        """`TileReader.read` with this process's decode threads."""
        return self.reader.read(
            rows,
            out=out,
            encoded=encoded,
            threads=self.threads_here(),
            ahead=ahead,
            context_out=context_out,
        )

    def _samples(self, rows: np.ndarray, result: ReadResult) -> list[Sample]:
        cols = self.index.columns
        if self.stain is not None:  # context tiles as their tile: the same draw per row
            slide_ids = np.asarray(cols["slide_id"][rows], dtype=np.int64)
            for pixels in (result.pixels, *result.context):
                self.stain.apply_numpy(pixels, slide_ids, rows, self.epoch, result.ok)
        labels = self.tile_labels(rows).tolist()
        slide_ids = cols["slide_id"][rows].tolist()
        slide_labels = self.slide_labels[slide_ids].tolist()
        xs, ys = cols["l0_x"][rows].tolist(), cols["l0_y"][rows].tolist()
        oks = np.asarray(result.ok, dtype=bool).tolist()
        substituted = np.asarray(result.substituted, dtype=bool).tolist()
        images = self._planes(result.pixels)
        with_context = result.context_inside is not None and bool(self.context)
        context = [self._planes(tiles) for tiles in result.context] if with_context else []
        coverage = self.index.coverage
        samples = []
        for i, row in enumerate(rows.tolist()):
            image: Any = images[i]
            if self.transform is not None:
                image = self.transform(image)
            sample = {
                "image": image,
                "label": labels[i],
                "slide_label": slide_labels[i],
                "ok": oks[i],
                "substituted": substituted[i],
                "row": row,
                "slide_id": slide_ids[i],
                "x": xs[i],
                "y": ys[i],
            }
            if coverage is not None:
                sample["coverage"] = torch.from_numpy(np.array(coverage[row], dtype=np.float32))
            if with_context:
                assert result.context_inside is not None
                sample["context"] = [tiles[i] for tiles in context]
                sample["context_inside"] = torch.from_numpy(result.context_inside[i].copy())
            samples.append(sample)
        return samples

    def _planes(self, pixels: np.ndarray) -> torch.Tensor:
        """`channel_planes` of a read, in a reused buffer of ``item_buffers`` (a fresh one
        costs a page fault per 4 KiB page written) that comes free once no item over it is
        left; a fresh buffer when all of them are out."""
        n, h, w, channels = pixels.shape
        planes, recycled = self.item_buffers.take((n, channels, h, w), shared=False)
        channel_planes(pixels, planes.numpy())
        return lease(planes) if recycled else planes

    def _read_samples(self, rows: np.ndarray, threads: int) -> list[Sample]:
        """The samples of ``rows``: read into a reused buffer (never handed out: the items
        are `_planes` of it), free again as soon as they are made."""
        t = self.tile_size
        pixels, recycled = self.item_buffers.take((len(rows), t, t, 3), shared=False)
        try:
            return self._samples(rows, self.reader.read(rows, out=pixels.numpy(), threads=threads))
        finally:
            if recycled:
                release(pixels)

    def __getitem__(self, row: int) -> Sample:
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} out of range for {len(self)} tiles")
        return self._read_samples(np.array([row % len(self)], dtype=np.int64), threads=1)[0]

    def __getitems__(self, rows: Sequence[int]) -> list[Sample]:
        """Batched reads (used by DataLoader): rows are read grouped by slide."""
        return self._read_samples(np.asarray(rows, dtype=np.int64), self.threads_here())

    def _transform_in_place(self, pixels: np.ndarray) -> None:
        """Apply ``transform`` to every tile of an NHWC batch, writing the results back."""
        assert self.transform is not None
        for i in range(len(pixels)):
            out = self.transform(chw(pixels[i]))
            expected = (3, pixels.shape[1], pixels.shape[2])
            if (
                not isinstance(out, torch.Tensor)
                or out.dtype != torch.uint8
                or tuple(out.shape) != expected
            ):
                got = (
                    f"{out.dtype} {tuple(out.shape)}"
                    if isinstance(out, torch.Tensor)
                    else type(out).__name__
                )
                raise ConfigError(
                    f"in batches, transform must return a uint8 tensor of shape {expected} "
                    f"(got {got}); convert and resize on the device (DeviceLoader), or use "
                    "batch_transform",
                    key="transform",
                )
            pixels[i] = out.numpy().transpose(1, 2, 0)

    def _stain_in_place(
        self, pixels: np.ndarray, rows: np.ndarray, result: ReadResult, epoch: int
    ) -> None:
        """The stain transforms on a batch read into ``pixels`` (tiles still compressed for
        the device are left to `DeviceLoader`, with a warning once)."""
        assert self.stain is not None
        ok = np.asarray(result.ok, dtype=bool)
        if result.encoded is not None:
            encoded = np.array([e is not None for e in result.encoded], dtype=bool)
            if encoded.any() and not self._said_encoded:
                self._said_encoded = True
                log.warning(
                    "decode='device': tiles decoded on the device skip the dataset's stain "
                    "transforms; give them to DeviceLoader(stain=...) instead"
                )
            ok &= ~encoded
        slide_ids = np.asarray(self.index.columns["slide_id"][rows], dtype=np.int64)
        self.stain.apply_numpy(pixels, slide_ids, rows, epoch, ok)
        # context tiles are decoded here whatever ``decode``; the same transform (the same
        # random draw per row) as their tile, so that the scales of a row stay alike
        for tiles in result.context:
            self.stain.apply_numpy(tiles, slide_ids, rows, epoch, result.ok)

    def read_batch(
        self,
        rows: Sequence[int],
        encoded: bool = False,
        buffers: BufferRing | SlotRing | None = None,
        ahead: Sequence[int] | None = None,
        epoch: int | None = None,
    ) -> TileBatch:
        """Read rows into one `TileBatch` (NHWC uint8); see `make_loader`. ``ahead``: rows
        this process reads next, whose bytes are requested before this batch is decoded.

        With ``buffers``, the pixels go into a buffer of that ring that is reused once no
        tensor over this batch is left (``batch.recycled``; see `wsi_loader.dataset._buffers`);
        with a `SlotRing` (in a worker process), in a slot of that ring
        (`wsi_loader.dataset._transport`).
        """
        array = np.asarray(rows, dtype=np.int64)
        t = self.tile_size
        shape = (len(array), t, t, 3)
        # decoded straight into this buffer (shared memory inside a DataLoader worker)
        in_worker = get_worker_info() is not None
        shapes = [shape] + [(len(array), size, size, 3) for _, size in self.context]
        taken = BatchBuffers.take(
            shapes, buffers if self.batch_transform is None else None, shared=in_worker
        )
        images, context = taken.tensors[0], taken.tensors[1:]
        try:
            pixels = images.numpy()
            result = self.read_rows(
                array,
                out=pixels,
                encoded=encoded,
                ahead=ahead,
                context_out=[tiles.numpy() for tiles in context],
            )
            epoch = self.epoch if epoch is None else epoch
            if self.stain is not None:
                self._stain_in_place(pixels, array, result, epoch)
            if self.transform is not None:
                self._transform_in_place(pixels)
        except BaseException:
            taken.give_back()  # on_error="raise": the batch is never handed out
            raise
        cols = self.index.columns
        slide_id = np.asarray(cols["slide_id"][array], dtype=np.int64)
        ok = result.ok
        if result.encoded is not None:  # not ok until decoded (DeviceLoader): zeros till then
            ok = ok & np.array([e is None for e in result.encoded], dtype=bool)
        batch = TileBatch(
            images=images,
            ok=torch.tensor(ok),
            substituted=torch.tensor(result.substituted),
            rows=torch.tensor(array),
            slide_id=torch.tensor(slide_id),
            x=torch.tensor(np.asarray(cols["l0_x"][array], dtype=np.int64)),
            y=torch.tensor(np.asarray(cols["l0_y"][array], dtype=np.int64)),
            label=torch.from_numpy(self.tile_labels(array)),
            slide_label=torch.from_numpy(self.slide_labels[slide_id]),
            coverage=(
                None
                if self.index.coverage is None
                else torch.from_numpy(np.array(self.index.coverage[array], dtype=np.float32))
            ),
            recycled=taken.recycled[0],
            context=context if self.context else None,
            context_inside=(torch.from_numpy(result.context_inside) if self.context else None),
            epoch=epoch,
        )
        if self.batch_transform is not None:
            batch = self.batch_transform(batch)
            if not isinstance(batch, TileBatch):
                raise TypeError(
                    f"batch_transform must return a TileBatch, got {type(batch).__name__}"
                )
        taken.hand_out(batch, in_worker)
        if result.encoded is not None and any(e is not None for e in result.encoded):
            batch.encoded = result.encoded
            batch.slide_paths = [self.index.slides[int(i)].path for i in slide_id]
            batch.quarantine = str(self.index.quarantine.path)
            batch.on_error = self.reader.on_error
            batch.fingerprints = [self.index.slides[int(i)].fingerprint for i in slide_id]
            batch.levels = np.asarray(cols["level"][array]).tolist()
            batch.fill_value = self.reader.fill_value
        return batch
