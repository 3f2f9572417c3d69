"""`DeviceLoader`: overlap host-to-device copies with compute, normalise on the device.

On CUDA the next batch is copied ``non_blocking`` from pinned memory on a side stream while the
current batch is in use; the consumer's stream waits on the copy, and tensors are recorded on
the consumer's stream so the caching allocator never reuses them early. The uint8 NHWC batch is
permuted, converted and normalised on the device (a permuted NHWC tensor *is* channels_last, so
that layout costs nothing). On CPU the same code runs without streams, which is what CI tests.

Compressed tiles (``make_loader(decode="device")``) are decoded here: with nvJPEG through
``torchvision.io.decode_jpeg(device="cuda")`` when torchvision and a GPU are present (an optional
extra), otherwise with libjpeg-turbo on the CPU (simplejpeg, strict about corrupt data).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import simplejpeg
import torch

from wsi_loader.dataset._batch import TileBatch
from wsi_loader.dataset._buffers import BufferRing, lease
from wsi_loader.device._devices import resolve_device
from wsi_loader.errors import ConfigError, TileReadError
from wsi_loader.index._quarantine import Quarantine
from wsi_loader.index._table import SlideIndex
from wsi_loader.stain._build import as_stain

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


_NUMPY_FLOATS: dict[torch.dtype, type[np.floating[Any]]] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
}


def _gpu_decoder() -> Any:
    try:
        from torchvision.io import decode_jpeg  # optional extra
    except Exception:  # torchvision absent or built against another torch
        return None
    return decode_jpeg


def decode_encoded(
    batch: TileBatch,
    device: torch.device,
    unwritable: set[str] | None = None,
    quarantines: dict[str, Quarantine] | None = None,
) -> TileBatch:
    """Decode the compressed tiles of ``batch`` into ``batch.images`` (on ``device``).

    A tile that fails to decode is marked not ok and appended to the quarantine, then the
    dataset's policy applies: ``fill`` (white) or ``raise`` (`TileReadError`); ``substitute``
    is refused by `make_loader` for device decoding (no reader here to read another tile).
    A quarantine that cannot be written is said once per file in ``unwritable`` (the
    caller's: the files already said), and decoding goes on. ``quarantines`` (the caller's,
    by file) keep the `Quarantine` objects, which know the tiles recorded: a tile that fails
    every epoch is recorded once.
    """
    if not batch.encoded:
        return batch
    todo = [i for i, e in enumerate(batch.encoded) if e is not None]
    decoded: dict[int, torch.Tensor] = {}
    decoder = _gpu_decoder() if device.type == "cuda" else None
    if decoder is not None:
        streams = [
            torch.frombuffer(bytearray(batch.encoded[i] or b""), dtype=torch.uint8) for i in todo
        ]
        try:
            images = decoder(streams, device=device)
            decoded = {i: img.permute(1, 2, 0) for i, img in zip(todo, images, strict=True)}
        except RuntimeError as exc:  # one bad stream fails the call: fall back per tile
            log.debug("batched GPU decode failed (%s); decoding tiles on the CPU", exc)
    for i in todo:
        if i in decoded:
            continue
        try:
            # strict: libjpeg's corrupt-data warnings fail the tile, as on the worker's path
            pixels = simplejpeg.decode_jpeg(batch.encoded[i] or b"", colorspace="RGB", strict=True)
            decoded[i] = torch.from_numpy(np.ascontiguousarray(pixels))
        except Exception as exc:  # corrupt compressed tile
            _mark_failed(batch, i, f"{type(exc).__name__}: {exc}", unwritable, quarantines)
    if decoded and batch.images.device.type == "cpu":  # numpy: no intra-op thread pool
        rows = batch.images.numpy()
        for i, pixels in decoded.items():
            rows[i] = pixels.numpy()
    elif decoded:
        index = torch.tensor(list(decoded), dtype=torch.long, device=batch.images.device)
        stacked = torch.stack([decoded[i].to(batch.images.device) for i in decoded])
        batch.images.index_copy_(0, index, stacked)
    if decoded and batch.ok.device.type == "cpu":  # ok once decoded (see TileBatch)
        batch.ok.numpy()[list(decoded)] = True
    elif decoded:
        batch.ok[torch.tensor(list(decoded), dtype=torch.long, device=batch.ok.device)] = True
    batch.encoded = None
    return batch


def _mark_failed(
    batch: TileBatch,
    i: int,
    error: str,
    unwritable: set[str] | None = None,
    quarantines: dict[str, Quarantine] | None = None,
) -> None:
    batch.ok[i] = False
    if batch.images.device.type == "cpu":
        batch.images.numpy()[i] = batch.fill_value
    else:
        batch.images[i] = batch.fill_value
    log.warning("tile row %d failed to decode: %s", int(batch.rows[i]), error)
    path = batch.slide_paths[i] if batch.slide_paths else None
    if batch.quarantine and path is not None:
        record = {  # the fields of the dataset's own tile records (`_failures`)
            "kind": "tile",
            "slide_id": int(batch.slide_id[i]),
            "path": path,
            "fingerprint": batch.fingerprints[i] if batch.fingerprints else None,
            "x": int(batch.x[i]),
            "y": int(batch.y[i]),
            "level": batch.levels[i] if batch.levels else None,
            "row": int(batch.rows[i]),
            "error": error,
            "policy": batch.on_error,
        }
        kept = quarantines if quarantines is not None else {}
        quarantine = kept.setdefault(batch.quarantine, Quarantine(batch.quarantine))
        try:
            quarantine.record_tile(record)
        except OSError as exc:  # a read-only index: the failure is still in batch.ok
            said = unwritable if unwritable is not None else set()
            if batch.quarantine in said:
                log.debug("quarantine not written: %s", exc)
            else:
                said.add(batch.quarantine)
                log.warning(
                    "cannot write the quarantine %s (%s): failed decodes are still reported "
                    "(ok=False) but not recorded; pass quarantine=FILE to the dataset to "
                    "record them in a file you can write (said once per file)",
                    batch.quarantine,
                    exc,
                )
    if batch.on_error == "raise":
        raise TileReadError(
            f"decoding failed at level-0 ({int(batch.x[i])}, {int(batch.y[i])}): {error}",
            path=path,
            l0_x=int(batch.x[i]),
            l0_y=int(batch.y[i]),
            cause=error,
        )


def _index_of(loader: Any) -> SlideIndex:
    """The index a loader reads: make_loader's, or a DataLoader's `TileDataset`'s."""
    for holder in (getattr(loader, "tiles", None), getattr(loader, "dataset", None)):
        index = getattr(holder, "index", None)
        if isinstance(index, SlideIndex):
            return index
    raise ConfigError(
        "stain transforms need the index the loader reads, and this loader has none to find "
        "(make_loader's and DataLoader(TileDataset) have): pass DeviceLoader(..., index=...)",
        key="stain",
    )


class DeviceLoader:
    """Wrap a loader of `TileBatch` (or default-collated sample dicts) and yield dicts whose
    ``image`` is a normalised float tensor ``(N, 3, H, W)`` on ``device``. Batches with context
    tiles also get ``context`` (one such tensor per scale, normalised alike) and, from
    `TileBatch`, ``context_mask`` (one ``(N, size, size)`` bool tensor per scale: True where
    the context tile is on the slide).

    ``mean``/``std`` are in [0, 1] units (ImageNet's by default; ``None`` gives plain /255).
    ``wait_seconds`` accumulates the time the consumer waited for the next batch.
    ``stain``: stain transforms of `wsi_loader.stain` (one or a list: ``Normalize("macenko")``,
    ``HEDJitter(0.05, 0.05)``...), applied to whole batches on ``device`` before the
    conversion, bound to the loader's index (``index`` when the loader has none); a
    `StainPipeline` already bound (``.bind(index)``) is used as it is.
    """

    def __init__(
        self,
        loader: Iterable[TileBatch | dict[str, Any]],
        device: str | torch.device = "cuda",
        *,
        mean: Sequence[float] | None = IMAGENET_MEAN,
        std: Sequence[float] | None = IMAGENET_STD,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = True,
        stain: Any = None,
        index: SlideIndex | None = None,
    ) -> None:
        self.loader = loader
        steps = as_stain(stain)
        if steps is not None and not steps.bound:
            steps = steps.bind(index or _index_of(loader))
        self.stain = steps  # a pipeline bound already (a model pass binds once) as it is
        self.device = resolve_device(device)
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        if std is not None and any(s <= 0 for s in std):
            raise ValueError(f"std must be positive, got {tuple(std)}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point type, got {dtype}")
        self.dtype = dtype
        self.channels_last = channels_last
        mean_t = torch.tensor(mean if mean is not None else (0.0, 0.0, 0.0), dtype=torch.float64)
        std_t = torch.tensor(std if std is not None else (1.0, 1.0, 1.0), dtype=torch.float64)
        # x / 255 then (x - mean) / std, folded into one multiply-add
        self._scale = (1.0 / (255.0 * std_t)).view(1, 3, 1, 1).to(self.device, dtype)
        self._shift = (-mean_t / std_t).view(1, 3, 1, 1).to(self.device, dtype)
        # the same constants for the numpy path on the CPU (float32 / float64 only)
        self._np_dtype = _NUMPY_FLOATS.get(dtype)
        if self._np_dtype is not None:
            self._np_scale = self._scale.cpu().reshape(3).numpy().astype(self._np_dtype)
            self._np_shift = self._shift.cpu().reshape(3).numpy().astype(self._np_dtype)
        # the constants over a whole tile, per tile size (see `_convert_on_cpu`)
        self._tile_constants: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        # float batches on the CPU: reused once the consumer has let go of them (see
        # `_convert_on_cpu`); a consumer that keeps more gets fresh ones
        self._floats = BufferRing(capacity=4)
        self._unwritable: set[str] = set()  # quarantine files found read-only (said once)
        self._quarantines: dict[str, Quarantine] = {}  # by file: they know the tiles recorded
        self._stream = (
            torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            if self.device.type == "cuda"
            else None
        )
        self.wait_seconds = 0.0
        self.batches = 0

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _convert_on_cpu(self, nhwc: torch.Tensor) -> torch.Tensor:
        """The CPU conversion in numpy: one thread, never torch's intra-op pool (whose spinning
        threads cost 5-10x on a machine with other busy processes). Same float arithmetic
        (cast, multiply, then add, in ``dtype``) as the device path.

        Why it is written this way (2-core VM, 64 tiles of 224 px, one batch): the output
        goes into a reused buffer (`BufferRing`; a fresh 38 MB array costs a page fault and a
        zeroed page per 4 KiB, ~a third of the time); it is converted a tile at a time, so the
        multiply and the add find the tile's floats in the cache (~30% less); and the
        per-channel constants are laid out over a whole tile, so that numpy broadcasts
        nothing: broadcasting the 3 channels is ~5x slower, broadcasting a row of them along
        the tile's rows takes numpy's buffered loop (a copy of each operand, ~20% more)."""
        assert self._np_dtype is not None
        n, h, w, c = nhwc.shape
        rows = nhwc.numpy().reshape(n * h, w * c)
        scale, shift = self._constants(h, w)
        itemsize = np.dtype(self._np_dtype).itemsize
        buffer, recycled = self._floats.take((n * h * w * c * itemsize,), shared=False)
        if recycled:  # freed when the last tensor over the pixels is gone
            buffer = lease(buffer)
        pixels = buffer.numpy().view(self._np_dtype).reshape(n * h, w * c)
        for top in range(0, n * h, h):  # a tile at a time: its floats stay in the cache
            tile = pixels[top : top + h]
            tile[...] = rows[top : top + h]
            tile *= scale
            tile += shift
        image = torch.from_numpy(pixels.reshape(n, h, w, c)).permute(0, 3, 1, 2)  # NCHW view
        if self.channels_last:
            return image
        return torch.from_numpy(np.ascontiguousarray(image.numpy()))

    def _constants(self, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``scale`` and ``shift`` repeated over a (height, width * 3) tile."""
        key = (height, width)
        if key not in self._tile_constants:
            scale, shift = (
                np.ascontiguousarray(np.broadcast_to(np.tile(c, width), (height, width * 3)))
                for c in (self._np_scale, self._np_shift)
            )
            self._tile_constants[key] = (scale, shift)
        return self._tile_constants[key]

    def _prepare(self, batch: TileBatch | dict[str, Any]) -> dict[str, Any]:
        """Copy to the device and convert; runs on the side stream when there is one."""
        if isinstance(batch, TileBatch) and self.device.type == "cpu" and self._np_dtype:
            moved = decode_encoded(batch, self.device, self._unwritable, self._quarantines)
            if self.stain is not None:  # numpy, in place: the batch is this process's now
                for tiles in (moved.images, *(moved.context or ())):  # context as its tile
                    self.stain.apply_numpy(
                        tiles.numpy(), moved.slide_id, moved.rows, moved.epoch, moved.ok
                    )
            out = moved.as_dict()
            out["image"] = self._convert_on_cpu(moved.images)
            if moved.context is not None:  # every scale normalised alike
                out["context"] = [self._convert_on_cpu(tiles) for tiles in moved.context]
                out["context_mask"] = [moved.context_mask(k) for k in range(len(moved.context))]
            return out
        masks = None
        if isinstance(batch, TileBatch):
            moved = batch.to(self.device, non_blocking=True)
            moved = decode_encoded(moved, self.device, self._unwritable, self._quarantines)
            if self.stain is not None:
                moved.images = self.stain.apply_torch(
                    moved.images, batch.slide_id, batch.rows, batch.epoch, moved.ok
                )
                if moved.context is not None:  # context tiles as their tile
                    moved.context = [
                        self.stain.apply_torch(t, batch.slide_id, batch.rows, batch.epoch, moved.ok)
                        for t in moved.context
                    ]
            out = moved.as_dict()
            if moved.context is not None:
                masks = [moved.context_mask(k) for k in range(len(moved.context))]
        else:  # default-collated dicts from a plain DataLoader(TileDataset)
            out = {k: self._to_device(v) for k, v in batch.items()}
            if self.stain is not None:
                epoch = int(getattr(getattr(self.loader, "dataset", None), "epoch", 0))
                stain = self.stain

                def stained(nchw: torch.Tensor) -> torch.Tensor:
                    nhwc = stain.apply_torch(
                        nchw.permute(0, 2, 3, 1),
                        batch["slide_id"],
                        batch["row"],
                        epoch,
                        batch["ok"],
                    )
                    return nhwc.permute(0, 3, 1, 2)

                out["image"] = stained(out["image"])
                if out.get("context") is not None:  # context tiles as their tile
                    out["context"] = [stained(tiles) for tiles in out["context"]]
        out["image"] = self._normalise(out["image"])
        if out.get("context") is not None:  # every scale normalised alike
            out["context"] = [self._normalise(tiles) for tiles in out["context"]]
        if masks is not None:
            out["context_mask"] = masks
        return out

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=True)
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            return [v.to(self.device, non_blocking=True) for v in value]  # context tiles
        return value

    def _normalise(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW on the device -> normalised ``dtype`` in the chosen memory format."""
        image = image.to(self.dtype).mul_(self._scale).add_(self._shift)  # in place
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        return image.contiguous(memory_format=fmt)

    def _load(self, iterator: Iterator[TileBatch | dict[str, Any]]) -> dict[str, Any] | None:
        start = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return None
        finally:
            self.wait_seconds += time.perf_counter() - start
        if self._stream is None:
            return self._prepare(batch)
        with torch.cuda.stream(self._stream):
            return self._prepare(batch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        iterator = iter(self.loader)
        upcoming = self._load(iterator)
        while upcoming is not None:
            current = upcoming
            if self._stream is not None:
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_stream(self._stream)
                for value in current.values():
                    for tensor in value if isinstance(value, list) else [value]:
                        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                            tensor.record_stream(consumer)
            self.batches += 1
            yield current
            # the consumer has queued its (asynchronous) work on `current`: the next copy,
            # issued on the side stream, overlaps it
            upcoming = self._load(iterator)
