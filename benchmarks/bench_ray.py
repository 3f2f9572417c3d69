"""Tiles per second into ``iter_torch_batches`` on a local Ray cluster: `wsi_loader.ray.tiles`
against ratiopath's own Ray Data pipeline, and against our `make_loader` (no Ray) on the same
cores, same slides, same tiles.

    .venv/bin/python benchmarks/bench_ray.py [--slides 2] [--width 8192] [--cpus 2]
        [--rounds 3] [--batch-size 64] [--ratiopath SITE_PACKAGES] [--scratch DIR]

ratiopath (RationAI) is run as its documentation describes: ``read_slides`` (one row of
metadata per slide) -> ``flat_map`` of `ratiopath.tiling.grid_tiles` (one row per tile) ->
``map_batches(read_slide_tiles)`` (OpenSlide ``read_region`` per tile, composited on white).
It is not a dependency: install it into a virtual environment of its own (``pip install
ratiopath`` with its dependencies) and pass that environment's site-packages as
``--ratiopath``; without it, only our two are measured.

The grid is level 0, 256 px, stride 256, over slides whose sides are multiples of 256, so both
read exactly the same tiles (our index keeps every tile: ``min_tissue=0``). The rounds are
interleaved (each round runs every contestant once, in turn) so that a busy machine slows
them alike, after one round that is not counted (Ray's workers starting, imports, the page
cache); the table gives the best and the median round of each, and the ratios of ours to
the others.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import scratch_folder, synthetic_slide

REPO = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, REPO)

from wsi_loader.dataset import make_loader  # noqa: E402
from wsi_loader.index import SlideIndex, build_index  # noqa: E402

TILE = 256


def ours(index: SlideIndex, batch: int) -> Callable[[], int]:
    from wsi_loader.ray import TileSource

    source = TileSource(index, batch_size=batch, columns=["image", "slide_id", "x", "y", "ok"])

    def run() -> int:
        seen = 0
        for tiles in source.dataset(0).iter_torch_batches(batch_size=batch):
            seen += len(tiles["image"])
        return seen

    return run


def ratiopath_pipeline(paths: list[str], batch: int) -> Callable[[], int]:
    from ratiopath.ray import read_slides
    from ratiopath.tiling import grid_tiles, read_slide_tiles

    def tiling(row: dict[str, Any]) -> list[dict[str, Any]]:
        extent = (int(row["extent_x"]), int(row["extent_y"]))
        size = (int(row["tile_extent_x"]), int(row["tile_extent_y"]))
        stride = (int(row["stride_x"]), int(row["stride_y"]))
        return [
            {
                "path": row["path"],
                "tile_x": int(x),
                "tile_y": int(y),
                "level": int(row["level"]),
                "tile_extent_x": size[0],
                "tile_extent_y": size[1],
            }
            for x, y in grid_tiles(extent, size, stride, last="drop")
        ]

    def run() -> int:
        slides = read_slides(paths, tile_extent=TILE, stride=TILE, level=0)
        tiles = slides.flat_map(tiling).map_batches(read_slide_tiles, batch_size=batch)
        seen = 0
        for out in tiles.select_columns(["tile"]).iter_torch_batches(batch_size=batch):
            seen += len(out["tile"])
        return seen

    return run


def local_loader(index: SlideIndex, batch: int, workers: int) -> Callable[[], int]:
    def run() -> int:
        seen = 0
        for tiles in make_loader(index, batch, num_workers=workers, shuffle=False):
            seen += len(tiles)
        return seen

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slides", type=int, default=2)
    parser.add_argument("--width", type=int, default=8192, help="a multiple of 1024")
    parser.add_argument("--cpus", type=int, default=2, help="Ray's CPUs and make_loader's workers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--ratiopath", metavar="SITE_PACKAGES", help="where ratiopath is installed")
    parser.add_argument("--scratch", help="keep slides and index here between runs")
    args = parser.parse_args()
    if args.width % 1024:
        parser.error("--width must be a multiple of 1024 (whole tiles on both sides)")
    import ray

    folder = scratch_folder(args.scratch, "bench-ray-")
    slides_dir = folder / "slides"
    slides_dir.mkdir(exist_ok=True)
    paths = [
        str(synthetic_slide(slides_dir / f"s{i}-{args.width}.svs", width=args.width, seed=i))
        for i in range(args.slides)
    ]
    index = build_index(
        paths, folder / f"index-{args.slides}x{args.width}", tile_size=TILE, level=0, min_tissue=0.0
    )
    if args.ratiopath:  # for Ray's workers too
        sys.path.insert(0, args.ratiopath)
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([args.ratiopath, REPO, *inherited])
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    contestants: dict[str, Callable[[], int]] = {
        "wsi_loader.ray.tiles": ours(index, args.batch_size),
        f"make_loader ({args.cpus} workers)": local_loader(index, args.batch_size, args.cpus),
    }
    if args.ratiopath:
        contestants["ratiopath"] = ratiopath_pipeline(paths, args.batch_size)
    for run in contestants.values():  # not counted: Ray's workers start, imports, page cache
        run()
    rates: dict[str, list[float]] = {name: [] for name in contestants}
    for _ in range(args.rounds):
        for name, run in contestants.items():
            start = time.perf_counter()
            seen = run()
            elapsed = time.perf_counter() - start
            if seen != len(index):
                raise SystemExit(f"{name} read {seen} tiles, the index has {len(index)}")
            rates[name].append(seen / elapsed)
    print(
        f"{len(index)} tiles of {TILE} px from {args.slides} slides ({args.width} px wide), "
        f"{args.cpus} CPUs, batch {args.batch_size}, {args.rounds} interleaved rounds"
    )
    print(f"{'':32} {'best tiles/s':>13} {'median':>9} {'ours/this (median)':>19}")
    mine = statistics.median(rates["wsi_loader.ray.tiles"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:32} {max(values):13.0f} {median:9.0f} {mine / median:18.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
