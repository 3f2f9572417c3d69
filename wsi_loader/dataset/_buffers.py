"""Batch buffers that a reading process reuses once the consumer has let go of them.

Why: a fresh shared-memory batch buffer costs the worker a page fault per 4 KiB page when it
first writes it, and the kernel's zeroing of those pages: a large share of a worker's time,
which reused buffers save (benchmarks/README.md, "Batch buffers").

How a buffer is known to be free, without trusting anyone to call "release":
- every ring buffer starts with a header whose first int64 is 1 while a batch is out, 0 when
  free; the header lives in the same (shared) memory as the pixels;
- the consumer's tensor over the pixels is made by `lease`: a numpy array whose base object
  clears the header flag in its finaliser, wrapped by ``torch.from_numpy``. torch keeps that
  array alive for as long as any tensor, view or storage over the pixels exists, so the flag
  is cleared exactly when the last of them is gone, in whichever process holds them;
- the reading process takes a buffer only when its flag is 0, and otherwise allocates a new
  one (up to ``capacity``) or falls back to a fresh, unrecycled buffer.

A batch forwarded to another process is copied by torch into new shared memory (its storage is
not torch's own shared memory), so it can never see the buffer being reused.
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import numpy.typing as npt
import torch

HEADER_BYTES = 64  # keeps the pixels 64-byte aligned


class _Lease:
    """The base object of the consumer's pixel array: frees the ring slot when collected."""

    def __init__(self, pixels: npt.NDArray[np.uint8], flag: npt.NDArray[np.int64]) -> None:
        self.__array_interface__ = pixels.__array_interface__
        self._pixels = pixels  # keeps the mapping alive while the lease exists
        self._flag = flag

    def __del__(self) -> None:
        self._flag[0] = 0


def _flag(base: torch.Tensor) -> npt.NDArray[np.int64]:
    """The in-use flag at the start of a ring buffer's storage."""
    header = torch.empty(0, dtype=torch.uint8).set_(
        base.untyped_storage(), 0, (HEADER_BYTES,), (1,)
    )
    flag: npt.NDArray[np.int64] = header.numpy().view(np.int64)
    return flag


def lease(images: torch.Tensor) -> torch.Tensor:
    """A tensor over the same pixels as ``images`` (a view into a ring buffer) whose release,
    when the last tensor over it is gone, marks the ring buffer free."""
    if images.storage_offset() != HEADER_BYTES or not images.is_contiguous():
        raise ValueError("lease() takes the batch view of a ring buffer")
    array = np.asarray(_Lease(images.numpy(), _flag(images)))
    return torch.from_numpy(array)


def fresh_buffer(shape: tuple[int, ...], shared: bool) -> torch.Tensor:
    """A new uninitialised uint8 batch buffer. Inside a DataLoader worker it is shared memory,
    so the batch crosses the worker queue without a copy (torch would copy a numpy-backed one
    into new shared memory for every batch). Otherwise numpy allocates it,
    because numpy asks Linux for transparent huge pages on large arrays and torch does not:
    decoding into huge pages is ~6% faster on a 2-core VM (fewer TLB misses, which
    virtualisation makes dear). Shared memory gets none where ``shmem_enabled`` is never."""
    if not shared:
        return torch.from_numpy(np.empty(shape, dtype=np.uint8))
    images = torch.empty(shape, dtype=torch.uint8)
    images.share_memory_()  # type: ignore[no-untyped-call]
    return images


def release(images: torch.Tensor) -> None:
    """Mark the ring buffer under ``images`` free now (a batch that was never handed out)."""
    _flag(images)[0] = 0


class BufferRing:
    """Per-process ring of batch buffers (pickles without its buffers: each process has its
    own, and a forked child starts empty)."""

    def __init__(self, capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()  # threads of one process may share a dataset
        self._pid = os.getpid()
        self._buffers: list[tuple[torch.Tensor, npt.NDArray[np.int64], bool]] = []

    def __getstate__(self) -> dict[str, int]:
        return {"capacity": self.capacity}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["capacity"])  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self._buffers) if self._pid == os.getpid() else 0

    def take(self, shape: tuple[int, ...], shared: bool) -> tuple[torch.Tensor, bool]:
        """A uint8 tensor of ``shape`` to read a batch into, and whether it is a ring buffer
        (then the caller must hand out only `lease` views of it). ``shared``: allocate in
        shared memory (inside a DataLoader worker)."""
        need = math.prod(shape)
        if self._pid != os.getpid():  # forked: the parent's buffers (and lock) are not ours
            self._pid, self._buffers, self._lock = os.getpid(), [], threading.Lock()
        with self._lock:
            for base, flag, in_shm in self._buffers:
                if flag[0] == 0 and base.numel() - HEADER_BYTES >= need and in_shm == shared:
                    flag[0] = 1
                    return base[HEADER_BYTES : HEADER_BYTES + need].view(shape), True
            if len(self._buffers) < self.capacity:
                base = fresh_buffer((HEADER_BYTES + need,), shared)
                flag = _flag(base)
                flag[0] = 1
                self._buffers.append((base, flag, shared))
                return base[HEADER_BYTES:].view(shape), True
        return fresh_buffer(shape, shared), False
