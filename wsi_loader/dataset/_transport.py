"""How `make_loader`'s worker processes hand batches to the consumer: shared-memory slots
allocated once per set of workers, each batch sent as its metadata and a slot number.

Why: torch sends a tensor to another process as a shared-memory file descriptor, passed per
batch through multiprocessing's resource sharer: the consumer connects to a thread of the
worker, both sides authenticate (an HMAC challenge each way), the descriptor crosses, and the
consumer maps a new segment. Profiled with 2 workers, that was ~60% of the consumer's time
per batch (benchmarks/README.md, "Worker transport"). Here one memory file (``memfd``) is made
before the workers start, inherited by forked workers and sent once to spawned and forkserver
ones, and mapped once by each process.

How a slot is known free, without trusting anyone to call "release" (as in `_buffers`): a
flag per slot at the start of the shared memory, set by the worker that takes the slot and
cleared by the consumer's `lease` finaliser when the last tensor over the batch is gone. Each
worker has slots of its own, so no two processes ever set the same flag. A worker whose slots
are all taken (a consumer keeping many batches alive) sends that batch the old way (torch's
shared memory) and counts it in the shared header (`SlotRing.fallbacks`): no deadlock.

A ring belongs to one set of worker processes (one DataLoader iterator; once per loader with
persistent workers): a worker that died holding a slot, or batches of stopped workers nobody
received, leave nothing behind for the next set. Batches drained by torch (an epoch left in
the middle, with persistent workers) are received and dropped, which frees their slots.

Not page-locked: with ``pin_memory`` torch's pin thread still copies each batch into its own
pinned memory, and the slot is free again once that copy is done. Registering the slots with
CUDA (``cudaHostRegister``) would save that copy, but an asynchronous copy to the device from
memory torch did not allocate is not tracked by torch (its pinned allocator records an event
per copy and keeps the block until it completes): a batch dropped right after
``.to("cuda", non_blocking=True)`` would free its slot while the copy still reads it, and the
worker could overwrite it. Doing it safely needs the copy's stream event kept by the lease.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import multiprocessing.context
import multiprocessing.reduction
import os
import secrets
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import get_worker_info

from wsi_loader.dataset._buffers import (
    HEADER_BYTES,
    BufferRing,
    _Lease,
    fresh_buffer,
    lease,
    release,
)

if TYPE_CHECKING:
    from wsi_loader.dataset._batch import TileBatch

PAGE = mmap.PAGESIZE
ALIGN = HEADER_BYTES  # each tensor of a slot starts 64-byte aligned, like a ring buffer's pixels

Shapes = tuple[tuple[int, ...], ...]

# the rings this process made, by token, for the batches that name them (`receive`)
_RINGS: weakref.WeakValueDictionary[str, SlotRing] = weakref.WeakValueDictionary()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def slot_layout(shapes: Sequence[tuple[int, ...]]) -> tuple[list[int], int]:
    """The byte offsets of the uint8 tensors of ``shapes`` within a slot, and the bytes used."""
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end = _round_up(end + math.prod(shape), ALIGN)
    return offsets, end


class _Mapping:
    """One process's mapping of a ring; numpy arrays over it keep it (and the mmap) alive."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size)
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.address = int(whole.ctypes.data)
        self.__array_interface__ = whole.__array_interface__
        self._whole = whole
        self._pid = os.getpid()


class RingSlot(NamedTuple):
    """A taken slot in a worker: its number and the tensors to read the batch into."""

    ring: SlotRing
    slot: int
    tensors: list[torch.Tensor]

    def give_back(self) -> None:
        """The batch will never be sent (its read failed): the slot is free again."""
        self.ring.flags()[self.slot] = 0

    def address(self) -> tuple[str, int, Shapes]:
        """What travels with the batch instead of its pixels (see `receive`)."""
        return self.ring.token, self.slot, tuple(tuple(t.shape) for t in self.tensors)


class SlotRing:
    """``slots_per_worker`` slots of ``slot_bytes`` for each of ``workers`` worker processes,
    made in the consumer before the workers start. Pickles (for spawn and forkserver workers)
    with its memory file while a process is being started, and without it otherwise."""

    def __init__(self, workers: int, slots_per_worker: int, slot_bytes: int) -> None:
        if workers < 1 or slots_per_worker < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots: {workers}, {slots_per_worker}, {slot_bytes}")
        self.workers, self.slots_per_worker = workers, slots_per_worker
        self.slot_bytes = _round_up(slot_bytes, PAGE)  # each slot starts a page of its own
        slots = workers * slots_per_worker
        self.header_bytes = _round_up(8 * (slots + workers), PAGE)
        self.size = self.header_bytes + slots * self.slot_bytes
        self.token = secrets.token_hex(8)
        self._consumer = os.getpid()
        self._fd: int | None = os.memfd_create("wsi-loader-batches", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.size)  # pages are allocated when first written
        self._mapping: _Mapping | None = _Mapping(self._fd, self.size)
        _RINGS[self.token] = self

    @staticmethod
    def available() -> bool:
        return hasattr(os, "memfd_create")

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k != "_mapping"}
        spawning = multiprocessing.context.get_spawning_popen() is not None
        # the descriptor goes with a process being started (as its arguments), nowhere else
        state["_fd"] = (
            multiprocessing.reduction.DupFd(self._fd) if spawning and self._fd is not None else None
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        fd = state.pop("_fd")
        self.__dict__.update(state)
        self._fd = None if fd is None else fd.detach()
        self._mapping = None

    def workers_started(self) -> None:
        """In the consumer, once its workers have the memory: close the descriptor (the memory
        goes when the last mapping does)."""
        if self._fd is not None and os.getpid() == self._consumer:
            os.close(self._fd)
            self._fd = None

    def _mapped(self) -> _Mapping | None:
        """This process's mapping (a worker maps the memory on its first batch)."""
        if self._mapping is not None and self._mapping._pid == os.getpid():
            return self._mapping
        if self._fd is None:
            return None  # pickled outside a process start: no memory to share
        self._mapping = _Mapping(self._fd, self.size)
        with contextlib.suppress(OSError):
            os.close(self._fd)  # a worker's own copy
        self._fd = None
        return self._mapping

    def flags(self) -> npt.NDArray[np.int64]:
        """Per slot: 1 while its batch is out, 0 when free; then a fallback count per worker."""
        mapping = self._mapped()
        assert mapping is not None
        slots = self.workers * self.slots_per_worker
        counts: npt.NDArray[np.int64] = np.asarray(mapping).view(np.int64)[: slots + self.workers]
        return counts

    @property
    def fallbacks(self) -> int:
        """Batches sent through torch's shared memory because their worker had no free slot."""
        slots = self.workers * self.slots_per_worker
        return int(self.flags()[slots:].sum())

    def take(self, shapes: Sequence[tuple[int, ...]]) -> RingSlot | None:
        """In worker process ``k``: a free slot of its own holding uint8 tensors of ``shapes``;
        None where the ring cannot carry the batch (too large, or no slot free: counted)."""
        worker = get_worker_info()
        if worker is None or worker.id >= self.workers or self._mapped() is None:
            return None
        offsets, used = slot_layout(shapes)
        flags = self.flags()
        first = worker.id * self.slots_per_worker
        free = [s for s in range(first, first + self.slots_per_worker) if flags[s] == 0]
        if used > self.slot_bytes or not free:
            flags[self.workers * self.slots_per_worker + worker.id] += 1
            return None
        slot = free[0]  # the lowest: the fewest pages ever touched
        flags[slot] = 1
        start = self.header_bytes + slot * self.slot_bytes
        whole = np.asarray(self._mapped())
        tensors = [
            torch.from_numpy(whole[start + at : start + at + math.prod(shape)].reshape(shape))
            for at, shape in zip(offsets, shapes, strict=True)
        ]
        return RingSlot(self, slot, tensors)

    def lease(self, slot: int, shapes: Shapes) -> list[torch.Tensor]:
        """In the consumer: tensors over the batch in ``slot``; the slot is free again when
        the last tensor over any of them is gone."""
        mapping = self._mapping
        if mapping is None or mapping._pid != os.getpid():
            raise RuntimeError("a ring's batches are received only by the process that made it")
        offsets, used = slot_layout(shapes)
        start = self.header_bytes + slot * self.slot_bytes
        whole = np.asarray(mapping)
        flags = self.flags()
        held = np.asarray(_Lease(whole[start : start + used], flags[slot : slot + 1]))
        return [
            torch.from_numpy(held[at : at + math.prod(shape)].reshape(shape))
            for at, shape in zip(offsets, shapes, strict=True)
        ]


def receive(token: str, slot: int, shapes: Shapes) -> list[torch.Tensor]:
    """In the consumer, unpickling a batch: its tensors, from the ring named ``token``."""
    ring = _RINGS.get(token)
    if ring is None:
        raise RuntimeError(
            "a batch arrived from a ring of batch slots this process does not have (batches "
            "sent by make_loader's workers are received by the process that iterates the loader)"
        )
    return ring.lease(slot, shapes)


class BatchBuffers:
    """Where one batch is read (``tensors``: the tiles', then each context scale's) and how
    it reaches the consumer: through a ring slot, through torch's shared memory in reused
    `BufferRing` buffers (``recycled``), or in fresh ones."""

    def __init__(
        self, tensors: list[torch.Tensor], recycled: list[bool], slot: RingSlot | None = None
    ) -> None:
        self.tensors, self.recycled, self.slot = tensors, recycled, slot

    @classmethod
    def take(
        cls,
        shapes: Sequence[tuple[int, ...]],
        buffers: BufferRing | SlotRing | None,
        shared: bool,
    ) -> BatchBuffers:
        """Buffers for uint8 tensors of ``shapes``: from ``buffers`` when it has them free,
        else fresh (``shared``: in torch's shared memory, inside a DataLoader worker)."""
        if isinstance(buffers, SlotRing):
            slot = buffers.take(shapes)
            if slot is not None:
                return cls(slot.tensors, [True] * len(shapes), slot)
            buffers = None  # a plain batch, as torch sends it
        if buffers is None:
            return cls([fresh_buffer(s, shared) for s in shapes], [False] * len(shapes))
        taken = [buffers.take(s, shared=shared) for s in shapes]
        return cls([t for t, _ in taken], [r for _, r in taken])

    def give_back(self) -> None:
        """The batch is never handed out (its read failed): its buffers are free again."""
        if self.slot is not None:
            self.slot.give_back()
            return
        for tensor, recycled in zip(self.tensors, self.recycled, strict=True):
            if recycled:
                release(tensor)

    def hand_out(self, batch: TileBatch, in_worker: bool) -> None:
        """Set ``batch`` up so that its buffers are reused only once the consumer lets go."""
        if self.slot is not None:
            batch.send_in_slot(self.slot.address())
            return
        images, context = self.recycled[0], self.recycled[1:]
        if in_worker and (images or any(context)):
            # the receiving process leases them when it unpickles the batch
            batch.lease_on_arrival(images, context)
        elif images or any(context):
            if images:
                batch.images = lease(batch.images)
            if batch.context is not None:
                batch.context = [
                    lease(tiles) if from_ring else tiles
                    for tiles, from_ring in zip(batch.context, context, strict=True)
                ]
