"""The per-item path against per-item peers, through the same plain DataLoader.

    .venv/bin/python benchmarks/bench_per_item.py [--tiles 2000] [--rounds 5] [--scratch DIR]

Every path is a map-style Dataset giving one dict per tile, read by
``DataLoader(ds, batch_size=64, num_workers=2, sampler=the same rows)`` with torch's default
collate (issue 53, item 4):

- ``TileDataset``: ours (the DataLoader calls its ``__getitems__``, one batch read per batch);
- cuCIM: ``CuImage(path).read_region`` per item, one handle per slide cached in each worker
  (rows only when cucim imports: run with a venv that has it, PYTHONPATH at this checkout);
- pooled OpenSlide: ``read_region`` per item, one handle per slide cached in each worker.

The peers' items carry the same keys as ours (image, label, slide_label, ok, substituted, row,
slide_id, x, y) so that the collate does the same work, and their image is what such a Dataset
usually returns, ``torch.from_numpy(pixels).permute(2, 0, 1)``. Rounds are interleaved (A B C,
A B C, ...) so that a slow spell of a busy machine hits every path alike; each pass is timed
from its first batch in hand to its last (worker start is `bench_first_batch.py`'s subject).
Prints best and median tiles/s, CPU us per tile (every process of the path), and ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import openslide
import torch
from common import scratch_folder, synthetic_slide
from torch.utils.data import DataLoader, Dataset

from wsi_loader.dataset import TileDataset
from wsi_loader.index import SlideIndex, build_index

try:
    import cucim
except ImportError:  # the row is left out
    cucim = None


class PeerDataset(Dataset[dict[str, Any]]):
    """A per-item Dataset over an index's rows with one handle per slide cached in each worker
    process (opened on first use there, dropped when pickled)."""

    def __init__(self, index: SlideIndex, read: Callable[[Any, int, int, int, int], np.ndarray]):
        self.index = index
        self.read = read
        self.labels = index.slide_labels()
        self.handles: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "handles": {}}

    def open(self, path: str) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, row: int) -> dict[str, Any]:
        cols = self.index.columns
        slide_id = int(cols["slide_id"][row])
        handle = self.handles.get(slide_id)
        if handle is None:
            handle = self.handles[slide_id] = self.open(self.index.slide_path(slide_id))
        x, y = int(cols["l0_x"][row]), int(cols["l0_y"][row])
        size = int(cols["read_size"][row])
        pixels = self.read(handle, x, y, int(cols["level"][row]), size)
        label = int(self.labels[slide_id])
        return {
            "image": torch.from_numpy(pixels).permute(2, 0, 1),
            "label": label,
            "slide_label": label,
            "ok": True,
            "substituted": False,
            "row": row,
            "slide_id": slide_id,
            "x": x,
            "y": y,
        }


class CucimDataset(PeerDataset):
    def open(self, path: str) -> Any:
        assert cucim is not None
        return cucim.CuImage(path)


def cucim_read(handle: Any, x: int, y: int, level: int, size: int) -> np.ndarray:
    return np.asarray(handle.read_region(location=(x, y), size=(size, size), level=level))


class OpenSlideDataset(PeerDataset):
    def open(self, path: str) -> Any:
        return openslide.OpenSlide(path)


def openslide_read(handle: Any, x: int, y: int, level: int, size: int) -> np.ndarray:
    rgba = np.asarray(handle.read_region((x, y), level, (size, size)))
    return np.ascontiguousarray(rgba[..., :3])


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (a DataLoader worker), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_pass(loader: DataLoader[Any]) -> tuple[float, float]:
    """Tiles/s from the first batch in hand to the last, and CPU us per tile of every process
    of the path (the workers' last readings, taken after every batch)."""
    iterator = iter(loader)
    next(iterator)
    pids = [child.pid for child in multiprocessing.active_children() if child.pid]
    start_cpu = {pid: cpu_seconds(pid) or 0.0 for pid in pids}
    last = dict(start_cpu)
    start, cpu, counted = time.perf_counter(), time.process_time(), 0
    for batch in iterator:
        counted += len(batch["image"])
        for pid in pids:
            last[pid] = cpu_seconds(pid) or last[pid]
    wall = time.perf_counter() - start
    used = time.process_time() - cpu + sum(last.values()) - sum(start_cpu.values())
    del iterator
    return counted / wall, used / counted * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", type=int, default=2000, help="tiles per pass")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=20_000, help="synthetic slide width")
    parser.add_argument("--scratch", help="folder for the slide and index (kept)")
    args = parser.parse_args()

    scratch = scratch_folder(args.scratch, "bench_per_item_")
    slide = synthetic_slide(scratch / f"slide_{args.width}.svs", width=args.width)
    folder = scratch / f"index_{args.width}"
    if folder.exists():
        index = SlideIndex.open(folder)
    else:
        index = build_index([slide], folder, tile_size=256, level=0, min_tissue=0.5)
    rng = np.random.default_rng(0)
    rows = np.concatenate(
        [rng.permutation(len(index)) for _ in range(-(-args.tiles // len(index)))]
    )
    order = rows[: args.tiles].tolist()

    def loader(ds: Dataset[Any]) -> DataLoader[Any]:
        return DataLoader(
            ds,
            batch_size=64,
            num_workers=args.workers,
            sampler=order,
            multiprocessing_context="fork",
        )

    paths: dict[str, DataLoader[Any]] = {
        "TileDataset": loader(TileDataset(index, record_failures=False)),
        "pooled OpenSlide": loader(OpenSlideDataset(index, openslide_read)),
    }
    if cucim is not None:
        paths["cuCIM per item"] = loader(CucimDataset(index, cucim_read))
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, path in paths.items():
            rates[name].append(one_pass(path))

    print(
        f"per-item DataLoader, batch 64, {args.workers} workers (fork), {args.tiles} random "
        f"tissue tiles of a {args.width} px synthetic SVS, {args.rounds} interleaved rounds; "
        f"torch {torch.__version__}, cucim {getattr(cucim, '__version__', 'absent')}, "
        f"load average at the end {os.getloadavg()[0]:.1f}"
    )
    best = {name: max(r for r, _ in runs) for name, runs in rates.items()}
    median = {name: statistics.median(r for r, _ in runs) for name, runs in rates.items()}
    print(f"{'path':<18} {'best':>8} {'median':>8} {'CPU us/tile':>12}   TileDataset is")
    for name, runs in rates.items():
        ratio = (
            ""
            if name == "TileDataset"
            else f"{best['TileDataset'] / best[name]:.2f}x best, "
            f"{median['TileDataset'] / median[name]:.2f}x median"
        )
        cpu = min(c for _, c in runs)
        print(f"{name:<18} {best[name]:8.0f} {median[name]:8.0f} {cpu:12.0f}   {ratio}")


if __name__ == "__main__":
    main()
