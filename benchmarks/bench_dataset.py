"""TileDataset: worker memory vs index size, and tiles/s vs the naive open-per-item Dataset.

    .venv/bin/python benchmarks/bench_dataset.py [--batches 1000] [--scratch DIR]

1. Private memory (USS, /proc/PID/smaps_rollup) of each DataLoader worker over N batches, for
   indexes of 10^4 and 10^7 rows, next to a Dataset that keeps the same rows as a Python list of
   tuples (what a naive implementation does): the numpy index stays flat.
2. Tiles/s through a DataLoader with 0, 1 and 2 workers, against a Dataset that opens an
   OpenSlide handle per item, in the same run.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import openslide
import torch
from common import scratch_folder, synthetic_slide
from torch.utils.data import DataLoader, Dataset

from wsi_loader.dataset import DistributedTileSampler, TileDataset
from wsi_loader.index import SlideIndex, SlideRecord, build_index
from wsi_loader.index._table_writer import write_index


def uss_mb(pid: int) -> float:
    """Unique set size: private clean + private dirty pages."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total / 1024


def _record_pid(_: int) -> None:
    with open(os.environ["BENCH_PID_FILE"], "a") as fh:
        fh.write(f"{os.getpid()}\n")


def synthetic_index(base: SlideIndex, rows: int, out: Path) -> SlideIndex:
    """An index of ``rows`` tiles cycling over ``base``'s real coordinates (one slide)."""
    reps = -(-rows // len(base))
    tiles = {name: np.tile(np.asarray(col), reps)[:rows] for name, col in base.columns.items()}
    record = SlideRecord(**{**base.slides[0].__dict__, "tiles": rows})
    return write_index(out, [record], [tiles], base.params, base.root)


class ListIndexDataset(Dataset[dict[str, Any]]):
    """The naive pattern: the index as a Python list of tuples, one handle per worker."""

    def __init__(self, index: SlideIndex) -> None:
        cols = index.columns
        self.items = list(
            zip(
                cols["l0_x"].tolist(),
                cols["l0_y"].tolist(),
                cols["level"].tolist(),
                cols["read_size"].tolist(),
                strict=True,
            )
        )
        self.path = index.slide_path(0)
        self.slide: openslide.OpenSlide | None = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.slide is None:
            self.slide = openslide.OpenSlide(self.path)
        x, y, level, size = self.items[i]
        rgba = np.asarray(self.slide.read_region((x, y), level, (size, size)))
        return {"image": torch.from_numpy(rgba[..., :3].copy()).permute(2, 0, 1)}


class NaiveDataset(Dataset[dict[str, Any]]):
    """Opens an OpenSlide handle for every item (what most tutorials do)."""

    def __init__(self, index: SlideIndex) -> None:
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        cols = self.index.columns
        slide = openslide.OpenSlide(self.index.slide_path(int(cols["slide_id"][i])))
        size = int(cols["read_size"][i])
        rgba = np.asarray(
            slide.read_region(
                (int(cols["l0_x"][i]), int(cols["l0_y"][i])), int(cols["level"][i]), (size, size)
            )
        )
        slide.close()
        return {"image": torch.from_numpy(rgba[..., :3].copy()).permute(2, 0, 1)}


def worker_memory(ds: Dataset[Any], batches: int, batch_size: int, scratch: Path) -> list[float]:
    pid_file = scratch / f"pids-{time.time_ns()}"
    os.environ["BENCH_PID_FILE"] = str(pid_file)
    sampler = DistributedTileSampler(ds, 1, 0, seed=0)  # type: ignore[arg-type]
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        num_workers=2,
        sampler=sampler,
        worker_init_fn=_record_pid,
        multiprocessing_context="fork",
    )
    samples: list[float] = []
    for i, _ in enumerate(loader):
        if i in (10, batches // 2, batches - 1):
            pids = [int(p) for p in pid_file.read_text().split()]
            samples.append(max(uss_mb(p) for p in pids))
        if i + 1 >= batches:
            break
    return samples


def throughput(ds: Dataset[Any], workers: int, batch_size: int, tiles: int) -> float:
    sampler = DistributedTileSampler(ds, 1, 0, seed=1)  # type: ignore[arg-type]
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        num_workers=workers,
        sampler=sampler,
        multiprocessing_context="fork" if workers else None,
    )
    it = iter(loader)
    next(it)  # start-up out of the measurement
    start, seen = time.perf_counter(), 0
    for batch in it:
        seen += len(batch["image"])
        if seen >= tiles:
            break
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--tiles", type=int, default=3000, help="tiles per throughput run")
    parser.add_argument("--scratch")
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-bench-ds-")
    slide = synthetic_slide(scratch / "slide.svs", seed=7)
    base = build_index([slide], scratch / "base", tile_size=256, level=0, min_tissue=0.5)

    print(
        f"## Worker USS (MB) at batch 10 / {args.batches // 2} / {args.batches} "
        "(2 fork workers, batch 16, 256 px)"
    )
    print(f"{'index rows':>11} {'numpy index (TileDataset)':>28} {'Python list index':>26}")
    for rows in (10**4, 10**7):
        index = synthetic_index(base, rows, scratch / f"idx-{rows}")
        ours = worker_memory(TileDataset(index), args.batches, 16, scratch)
        naive = worker_memory(ListIndexDataset(index), args.batches, 16, scratch)
        print(
            f"{rows:>11} {' / '.join(f'{v:.0f}' for v in ours):>28} "
            f"{' / '.join(f'{v:.0f}' for v in naive):>26}"
        )

    print("\n## Tiles/s through DataLoader (batch 64, 256 px aligned JPEG, shuffled)")
    ds = TileDataset(
        base, decode_threads=1
    )  # per core, like the naive Dataset (bench_fast: threads)
    naive_ds = NaiveDataset(base)
    rows_out = []
    for workers in (0, 1, 2):
        ours = throughput(ds, workers, 64, args.tiles)
        naive = throughput(naive_ds, workers, 64, args.tiles)
        rows_out.append((workers, ours, naive))
    print(f"{'workers':>8} {'TileDataset':>12} {'naive (handle per item)':>24} {'ratio':>6}")
    for workers, ours, naive in rows_out:
        print(f"{workers:>8} {ours:>12.0f} {naive:>24.0f} {ours / naive:>6.2f}")


if __name__ == "__main__":
    main()
