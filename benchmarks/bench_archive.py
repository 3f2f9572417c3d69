"""Random batches over an archive of many more slides than the handle pool keeps open.

    .venv/bin/python benchmarks/bench_archive.py [--slides 60] [--tiles 1920] [--scratch DIR]

The default sampler shuffles tiles across every slide, so a batch of 64 from an archive of
hundreds of slides touches ~60 of them, while a process keeps `max_open_slides` (16) files
open. Every batch then reopens most of its slides. This compares, in one run, one process
reading the same random batches (one decode thread, batch 64):

- without kept layouts (``layout_cache_mb=0``): every reopen parses the TIFF again;
- the default: closed raw readers keep their parsed layout, a reopen is one open();
- every slide open at once (``max_open_slides`` = the slide count): the ceiling;
- slide-grouped sampling (``slide_window=4``): the pool stays warm, batches mix 4 slides.

The archive is hard links to one synthetic slide (a copy where links fail): distinct paths,
so distinct handles, without writing N slides.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Any

import numpy as np
from common import scratch_folder, synthetic_slide

from wsi_loader.dataset import DistributedTileSampler, TileDataset
from wsi_loader.index import build_index


def rate(index: Any, order: list[int], batch: int, **options: Any) -> tuple[float, int, int]:
    """Tiles/s reading ``order`` in batches, and the slides the pool parsed and reopened."""
    ds = TileDataset(index, record_failures=False, decode_threads=1, **options)
    start = time.perf_counter()
    for i in range(0, len(order), batch):
        ds.read_batch(order[i : i + batch])
    tiles_per_s = len(order) / (time.perf_counter() - start)
    pool = ds.reader.pool
    return tiles_per_s, pool.opened, pool.reopened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slides", type=int, default=60)
    parser.add_argument("--tiles", type=int, default=1920)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--scratch")
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-bench-archive-")
    source = synthetic_slide(scratch / "source.svs", seed=5, mpp=0.5)
    archive = scratch / f"archive-{args.slides}"
    archive.mkdir(exist_ok=True)
    for i in range(args.slides):
        target = archive / f"slide-{i:04d}.svs"
        if not target.exists():
            try:
                os.link(source, target)
            except OSError:
                shutil.copy(source, target)
    index = build_index([archive], scratch / f"index-{args.slides}", tile_size=256, level=0)
    ds = TileDataset(index)
    shuffled = list(DistributedTileSampler(ds, num_replicas=1, rank=0, seed=0))[: args.tiles]
    grouped = list(DistributedTileSampler(ds, num_replicas=1, rank=0, seed=0, slide_window=4))[
        : args.tiles
    ]
    slides_per_batch = np.mean(
        [
            len(np.unique(index.columns["slide_id"][shuffled[i : i + args.batch_size]]))
            for i in range(0, len(shuffled), args.batch_size)
        ]
    )
    print(
        f"{args.slides} slides, {len(index)} tiles; {len(shuffled)} tiles in random batches of "
        f"{args.batch_size} touching {slides_per_batch:.0f} slides each; pool of 16 open files"
    )
    runs = {
        "no kept layouts (layout_cache_mb=0)": (shuffled, {"layout_cache_mb": 0}),
        "kept layouts (default)": (shuffled, {}),
        "every slide open": (shuffled, {"max_open_slides": args.slides}),
        "slide_window=4": (grouped, {}),
    }
    results = {name: rate(index, order, args.batch_size, **o) for name, (order, o) in runs.items()}
    base = results["no kept layouts (layout_cache_mb=0)"][0]
    for name, (tiles_per_s, opened, reopened) in results.items():
        print(
            f"{name:38s} {tiles_per_s:7.0f} tiles/s = {tiles_per_s / base:5.2f}x  "
            f"(parsed {opened}, reopened {reopened})"
        )


if __name__ == "__main__":
    main()
