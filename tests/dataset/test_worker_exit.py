from __future__ import annotations

import os
import time
from pathlib import Path

from torch.utils.data import DataLoader, Dataset

import wsi_loader.dataset.tiles  # noqa: F401 (what a worker holding a TileDataset imports)


class SlowToFree:
    """Stands in for a batch whose release the queue's feeder thread does: it frees slowly
    (letting go of the GIL, as torch does when it frees a tensor), then leaves a marker."""

    def __init__(self, folder: str, n: int) -> None:
        self.folder, self.n = folder, n
        Path(folder, f"made-{os.getpid()}-{n}").touch()

    def __del__(self) -> None:
        time.sleep(0.25)
        Path(self.folder, f"freed-{os.getpid()}-{self.n}").touch()


class SlowToFreeItems(Dataset[SlowToFree]):
    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, n: int) -> SlowToFree:
        return SlowToFree(self.folder, n)


def _markers(folder: Path, kind: str, pid: int) -> set[str]:
    return {p.name.rsplit("-", 1)[1] for p in folder.glob(f"{kind}-{pid}-*")}


def test_spawned_worker_frees_what_its_queue_holds_before_it_exits(tmp_path: Path) -> None:
    """Stopping a spawned worker with results in flight: the feeder thread finishes freeing
    them before the interpreter ends (else it is killed in the middle, and with real tensors
    the worker dies of SIGABRT)."""
    loader = DataLoader(
        SlowToFreeItems(tmp_path),
        batch_size=None,
        num_workers=1,
        prefetch_factor=4,
        multiprocessing_context="spawn",
    )
    it = iter(loader)
    next(it)
    worker = it._workers[0]  # type: ignore[attr-defined]
    del it  # shuts the worker down with its prefetched results still being freed
    worker.join(10)
    assert worker.exitcode == 0
    made = _markers(tmp_path, "made", worker.pid)
    assert len(made) >= 4  # the prefetched items were all in flight
    assert _markers(tmp_path, "freed", worker.pid) == made
