"""`TileBatch`: one contiguous NHWC uint8 tensor per batch plus per-tile metadata.

Workers read and decode a whole batch into one buffer and ship it as one tensor (stacking
per-item CHW tensors with the default collate costs more than decoding). The permute to
NCHW / channels_last happens on the device (`wsi_loader.device.DeviceLoader`). ``pin_memory()``
lets ``DataLoader(pin_memory=True)`` pin it.

In ``decode="device"`` mode, tiles that are single JPEG storage tiles travel compressed
(``encoded[i]`` is a complete JPEG stream) and are decoded in the main process, on the GPU when
there is one (`wsi_loader.device.DeviceLoader`); until then their rows of ``images`` are zero and
their ``ok`` is False, so a loop that forgot to decode them trains on none of them.

``recycled`` batches (from `make_loader`) live in a buffer the reading process reuses once
every tensor over it is gone (`wsi_loader.dataset._buffers`); those of worker processes travel
as a slot number of a shared ring (`wsi_loader.dataset._transport`).

With context scales (``context=[(mpp, size), ...]``), ``context[k]`` is one more NHWC uint8
buffer per scale, the co-centred tiles of the same rows (see `wsi_loader.dataset._context`);
``context_inside[:, k]`` says which part of each is on the slide (the rest is filled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from wsi_loader.dataset._buffers import lease
from wsi_loader.dataset._transport import receive


@dataclass
class TileBatch:
    """One batch of tiles as `make_loader`'s workers ship it: the pixels in one contiguous
    NHWC uint8 buffer (shared memory, no per-item collate) and one tensor per field, a row
    per tile. `DeviceLoader` turns it into the dict a `TileDataset` sample has (``image``
    normalised NCHW on the device); `as_dict` gives that dict on the CPU. ``ok`` is False
    where a tile could not be read (its pixels are ``fill_value``, or another tile's when
    ``substituted``), and, with ``decode="device"``, where it is still compressed in
    ``encoded`` until `DeviceLoader` decodes it: mask the loss with it.
    """

    images: torch.Tensor  # (N, H, W, 3) uint8, RGB
    ok: torch.Tensor  # (N,) bool: False when the requested tile could not be read
    substituted: torch.Tensor  # (N,) bool: pixels come from another tile of the slide
    rows: torch.Tensor  # (N,) int64 index rows
    slide_id: torch.Tensor  # (N,) int64
    x: torch.Tensor  # (N,) int64 level-0 top-left
    y: torch.Tensor  # (N,) int64
    label: torch.Tensor  # (N,) int64, -1 when unlabelled
    slide_label: torch.Tensor | None = None  # (N,) int64 the slide's label id
    coverage: torch.Tensor | None = None  # (N, classes) float32, annotated indexes only
    encoded: list[bytes | None] | None = None  # compressed tiles still to decode
    slide_paths: list[str] | None = None  # stored slide paths (for failures found later)
    quarantine: str | None = None  # where failures found after the worker are appended
    on_error: str = "fill"  # the dataset's policy, for tiles that fail after the worker
    fingerprints: list[str | None] | None = None  # of the slides, for quarantine records
    levels: list[int] | None = None  # the tiles' read levels, for quarantine records
    fill_value: int = 255  # the dataset's, for tiles that fail after the worker
    recycled: bool = False  # images live in a reused buffer (freed when no tensor is left)
    # one (N, size, size, 3) uint8 tensor per context scale, co-centred with ``images``
    context: list[torch.Tensor] | None = None
    # (N, scales, 4) int32: per context tile, its part on the slide (x0, y0, x1, y1; x1, y1
    # exclusive, in its pixels); the rest is the dataset's fill_value
    context_inside: torch.Tensor | None = None
    epoch: int = 0  # the epoch it was read in (random stain transforms on the device use it)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    # Small per-tile tensors travel by value (as numpy arrays inside the pickle): each tensor
    # sent from a DataLoader worker costs a shared-memory segment and a file descriptor,
    # ~50 us per tile for the seven metadata columns. Only `images` goes through shared memory.
    _BY_VALUE = (
        "ok",
        "substituted",
        "rows",
        "slide_id",
        "x",
        "y",
        "label",
        "slide_label",
        "coverage",
        "context_inside",
    )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if "_ring_slot" in state:  # the pixels stay where they are; the slot number travels
            state["images"] = None
            state["context"] = None
            state["_packed"] = pack_columns(state, self._BY_VALUE)
        for name in self._BY_VALUE:
            tensor = state.get(name)
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                state[name] = tensor.numpy()
        return state

    def lease_on_arrival(self, images: bool = True, context: list[bool] | None = None) -> None:
        """Mark ``images`` (and the ``context`` tensors flagged) as views into this process's
        `BufferRing`: the process that unpickles the batch wraps them with `lease`, so each
        buffer is reused only after that process has let go of it. (Not a field: copies made
        by ``pin_memory``/``to`` and re-pickled batches do not carry it.)"""
        self.__dict__["_lease_on_arrival"] = (images, list(context or []))

    def send_in_slot(self, address: tuple[str, int, tuple[tuple[int, ...], ...]]) -> None:
        """Mark ``images`` and ``context`` as the tensors of a slot of a `SlotRing` (``address``:
        the ring's token, the slot and the tensors' shapes): pickled, the batch carries the
        address instead of the pixels, and the receiving process leases them from its ring."""
        self.__dict__["_ring_slot"] = address

    def __setstate__(self, state: dict[str, Any]) -> None:
        slot = state.pop("_ring_slot", None)
        if slot is not None:
            images, *context = receive(*slot)
            state["images"], state["context"] = images, context or None
        packed = state.pop("_packed", None)
        if packed is not None:
            state.update(unpack_columns(*packed))
        leased = state.pop("_lease_on_arrival", None)
        if leased is True:  # (as older batches said it)
            leased = (True, [])
        if leased:
            images, context = leased
            if images:
                state["images"] = lease(state["images"])
            if context and state.get("context") is not None:
                state["context"] = [
                    lease(tiles) if flag else tiles
                    for tiles, flag in zip(state["context"], context, strict=True)
                ]
        for name in self._BY_VALUE:
            value = state.get(name)
            if value is not None and not isinstance(value, torch.Tensor):
                state[name] = torch.from_numpy(value)
        self.__dict__.update(state)

    def _map(self, fn: Any) -> TileBatch:
        changes: dict[str, Any] = {
            f.name: fn(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        if self.context is not None:
            changes["context"] = [fn(tiles) for tiles in self.context]
        # a copy (pinned, on a device) no longer lives in the reused buffer
        recycled = self.recycled and changes["images"] is self.images
        return replace(self, **changes, recycled=recycled)

    def context_mask(self, k: int) -> torch.Tensor:
        """(N, size, size) bool: True where context tile ``k``'s pixels are on the slide (built
        from ``context_inside``, on the batch's device)."""
        if self.context is None or self.context_inside is None:
            raise ValueError("this batch has no context tiles (make_loader(..., context=...))")
        return inside_mask(self.context_inside[:, k], int(self.context[k].shape[1]))

    def pin_memory(self) -> TileBatch:
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TileBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def as_dict(self) -> dict[str, Any]:
        """The same keys as `TileDataset` samples, images as NCHW (a view, no copy)."""
        return {
            "image": self.images.permute(0, 3, 1, 2),
            "label": self.label,
            "ok": self.ok,
            "substituted": self.substituted,
            "row": self.rows,
            "slide_id": self.slide_id,
            "x": self.x,
            "y": self.y,
            **({"slide_label": self.slide_label} if self.slide_label is not None else {}),
            **({"coverage": self.coverage} if self.coverage is not None else {}),
            **(
                {
                    "context": [tiles.permute(0, 3, 1, 2) for tiles in self.context],
                    "context_inside": self.context_inside,
                }
                if self.context is not None
                else {}
            ),
        }


# The per-tile columns of a batch sent in a ring slot travel packed in one buffer: unpickling
# a numpy array per column and wrapping each in a tensor was a large share of what is left of
# the consumer's cost per batch (benchmarks/README.md, "Worker transport"). The columns are
# copies the receiver owns, not views of the slot: a loop that keeps every batch's ``x`` must
# not keep the slots taken. Batches sent the old way (no free slot) are pickled as before.
Layout = tuple[tuple[str, str, int, tuple[int, ...]], ...]


def pack_columns(state: dict[str, Any], names: tuple[str, ...]) -> tuple[bytes, Layout]:
    """The CPU tensors of ``state`` named ``names``, in one buffer (each start 8-byte aligned),
    and where each is: (name, dtype name, offset, shape). Sets them to None in ``state``."""
    parts: list[bytes] = []
    layout: list[tuple[str, str, int, tuple[int, ...]]] = []
    offset = 0
    for name in names:
        tensor = state.get(name)
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            continue
        data = tensor.contiguous().numpy().tobytes()
        pad = -offset % 8
        parts += [bytes(pad), data]
        offset += pad
        layout.append((name, str(tensor.dtype).removeprefix("torch."), offset, tuple(tensor.shape)))
        offset += len(data)
        state[name] = None
    return b"".join(parts), tuple(layout)


def unpack_columns(data: bytes, layout: Layout) -> dict[str, torch.Tensor]:
    """The tensors `pack_columns` packed, over one writable copy of ``data``."""
    buffer = bytearray(data)
    columns = {}
    for name, dtype_name, offset, shape in layout:
        dtype = getattr(torch, dtype_name)
        count = math.prod(shape)
        if count == 0:
            columns[name] = torch.empty(shape, dtype=dtype)
            continue
        column = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
        columns[name] = column if len(shape) == 1 else column.view(shape)
    return columns


def inside_mask(boxes: torch.Tensor, size: int) -> torch.Tensor:
    """(N, size, size) bool masks of the boxes (N, 4: x0, y0, x1, y1, end exclusive)."""
    steps = torch.arange(size, device=boxes.device)
    x0, y0, x1, y1 = (boxes[:, j, None] for j in range(4))
    across = (steps >= x0) & (steps < x1)  # (N, size)
    down = (steps >= y0) & (steps < y1)
    return down[:, :, None] & across[:, None, :]
