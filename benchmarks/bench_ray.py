"""Tiles per second into ``iter_torch_batches`` on a local Ray cluster: `wsi_loader.ray.tiles`
against ratiopath's own Ray Data pipeline, and against our `make_loader` (no Ray) on the same
cores, same slides, same tiles.

    .venv/bin/python benchmarks/bench_ray.py [--slides 2] [--width 8192] [--cpus 2]
        [--rounds 3] [--batch-size 64] [--ratiopath SITE_PACKAGES] [--scratch DIR]
        [--address HOST:PORT] [--on RESOURCE ...]

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


def ours(index: SlideIndex, batch: int, resource: str | None = None) -> Callable[[], int]:
    """``resource``: read only on the node that has this custom resource."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from wsi_loader.ray import TileSource

    source = TileSource(index, batch_size=batch, columns=["image", "slide_id", "x", "y", "ok"])
    remote_args = None
    if resource:  # the node itself, not a share of its resource: Ray Data plans by resources
        node = next(n["NodeID"] for n in ray.nodes() if resource in n["Resources"])
        remote_args = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    def run() -> int:
        seen = 0
        dataset = source.dataset(0, ray_remote_args=remote_args)
        for tiles in dataset.iter_torch_batches(batch_size=batch):
            seen += len(tiles["image"])
        return seen

    return run


def ray_alone(index: SlideIndex, batch: int) -> Callable[[], int]:
    """Ray's own cost: the read tasks of ours (same count, same rows each) yielding blocks of
    the same columns and shapes without reading a tile (one filled image buffer per task)."""
    import numpy as np
    import ray.data
    from ray.data.block import BlockAccessor, BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    from wsi_loader.ray import TileSource

    runs = [len(rows) for _, rows in TileSource(index, batch_size=batch).runs(200)]

    def read(count: int) -> Any:
        image = np.full((batch, TILE, TILE, 3), 128, dtype=np.uint8)
        for start in range(0, count, batch):
            n = min(batch, count - start)
            ids = np.zeros(n, dtype=np.int64)
            yield BlockAccessor.batch_to_block(
                {"image": image[:n], "slide_id": ids, "x": ids, "y": ids, "ok": ids > -1}
            )

    class Empty(Datasource):  # type: ignore[misc]
        def estimate_inmemory_data_size(self) -> int:
            return len(index) * TILE * TILE * 3

        def get_read_tasks(self, parallelism: int, **_: Any) -> list[ReadTask]:
            meta = [
                BlockMetadata(
                    num_rows=n, size_bytes=n * TILE * TILE * 3, exec_stats=None, input_files=None
                )
                for n in runs
            ]
            return [ReadTask(lambda n=n: read(n), m) for n, m in zip(runs, meta, strict=True)]

    def run() -> int:
        seen = 0
        # as many blocks as tasks, as ours asks: more, and Ray cuts the blocks into pieces
        dataset = ray.data.read_datasource(Empty(), override_num_blocks=len(runs))
        for tiles in dataset.iter_torch_batches(batch_size=batch):
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


def tree_cpu_seconds() -> float:
    """CPU time of this process and of every process below it, live (Ray's GCS, raylet and
    workers, started by ``ray.init``) or ended (make_loader's workers): the work a run does,
    which other jobs on the machine do not change (Linux ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat.rpartition(")")[2].split()
        parent[int(entry)] = int(fields[1])
        # utime, stime, and the ended children's cutime, cstime
        used[int(entry)] = sum(int(f) for f in fields[11:15]) / tick
    mine = {os.getpid()}
    grew = True
    while grew:
        below = {pid for pid, ppid in parent.items() if ppid in mine} - mine
        grew = bool(below)
        mine |= below
    return sum(used[pid] for pid in mine if pid in used)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slides", type=int, default=2)
    parser.add_argument("--width", type=int, default=8192, help="a multiple of 1024")
    parser.add_argument("--cpus", type=int, default=2, help="Ray's CPUs and make_loader's workers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--ratiopath", metavar="SITE_PACKAGES", help="where ratiopath is installed")
    parser.add_argument("--scratch", help="keep slides and index here between runs")
    parser.add_argument(
        "--address", help="use this running Ray cluster (its CPUs, not --cpus) instead of a new one"
    )
    parser.add_argument(
        "--on",
        action="append",
        default=[],
        metavar="RESOURCE",
        help="also time ours with the read tasks held to the nodes with this custom resource "
        "(ray start --resources); may be repeated",
    )
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
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    contestants: dict[str, Callable[[], int]] = {
        "wsi_loader.ray.tiles": ours(index, args.batch_size),
        "Ray alone (blocks, no reading)": ray_alone(index, args.batch_size),
        **{f"ours, read on {r}": ours(index, args.batch_size, r) for r in args.on},
        f"make_loader ({args.cpus} workers)": local_loader(index, args.batch_size, args.cpus),
    }
    if args.ratiopath:
        contestants["ratiopath"] = ratiopath_pipeline(paths, args.batch_size)
    for run in contestants.values():  # not counted: Ray's workers start, imports, page cache
        run()
    rates: dict[str, list[float]] = {name: [] for name in contestants}
    cpu: dict[str, list[float]] = {name: [] for name in contestants}
    for _ in range(args.rounds):
        for name, run in contestants.items():
            used = tree_cpu_seconds()
            start = time.perf_counter()
            seen = run()
            elapsed = time.perf_counter() - start
            if seen != len(index):
                raise SystemExit(f"{name} read {seen} tiles, the index has {len(index)}")
            rates[name].append(seen / elapsed)
            cpu[name].append((tree_cpu_seconds() - used) / seen * 1000)
    print(
        f"{len(index)} tiles of {TILE} px from {args.slides} slides ({args.width} px wide), "
        f"{ray.cluster_resources().get('CPU', 0):.0f} Ray CPUs, batch {args.batch_size}, "
        f"{args.rounds} interleaved rounds"
    )
    print(
        f"{'':36} {'best tiles/s':>13} {'median':>9} {'ours/this (median)':>19} "
        f"{'CPU ms/tile (median)':>21}"
    )
    mine = statistics.median(rates["wsi_loader.ray.tiles"])
    for name, values in rates.items():
        median = statistics.median(values)
        work = f"{statistics.median(cpu[name]):21.2f}" if not args.address else f"{'-':>21}"
        print(f"{name:36} {max(values):13.0f} {median:9.0f} {mine / median:18.2f}x {work}")
    print(
        "CPU ms/tile: all processes of the run (the driver, Ray's GCS, raylet and workers, "
        "make_loader's workers); not with --address, whose processes are not ours"
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
