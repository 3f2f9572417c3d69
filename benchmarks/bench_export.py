"""Export throughput per format against the plain loop (OpenSlide read_region + PIL save), shard
sizes, and a 2-worker Dask LocalCluster against local processes, all in one run. Local exports
read and encode on usable cores / workers threads (the ``threads`` column).

    .venv/bin/python benchmarks/bench_export.py [--tiles 1500] [--scratch DIR]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import openslide
from common import scratch_folder, synthetic_slide

from wsi_loader.dataset.reading import threads_per_process
from wsi_loader.export import export_index
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index.table import write_index


def plain_loop(index: SlideIndex, out: Path, image_format: str) -> float:
    """What a script without wsi_loader does: one handle, read_region, PIL save."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cols = index.columns
    slide = openslide.OpenSlide(index.slide_path(0))
    start = time.perf_counter()
    for row in range(len(index)):
        size = int(cols["read_size"][row])
        region = slide.read_region(
            (int(cols["l0_x"][row]), int(cols["l0_y"][row])), int(cols["level"][row]), (size, size)
        ).convert("RGB")
        ext = "jpg" if image_format == "jpeg" else image_format
        region.save(out / f"{row}.{ext}", quality=90)
    seconds = time.perf_counter() - start
    slide.close()
    return len(index) / seconds


def ours(index: SlideIndex, out: Path, **options: object) -> tuple[float, list[dict[str, int]]]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    report = export_index(index, out, **options)  # type: ignore[arg-type]
    return report.tiles / (time.perf_counter() - start), report.shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiles", type=int, default=1500)
    parser.add_argument("--scratch")
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-bench-export-")
    slide = synthetic_slide(scratch / "slide.svs", seed=9)
    full = build_index([slide], scratch / "full", tile_size=256, level=0, min_tissue=0.5)
    keep = np.sort(np.random.default_rng(0).permutation(len(full))[: args.tiles])
    tiles = {name: np.asarray(col)[keep] for name, col in full.columns.items()}
    index = write_index(scratch / "idx", [full.slides[0]], [tiles], full.params, full.root)

    print(f"## {len(index)} tiles of 256 px, 2 cores")
    print(f"{'format':<26} {'workers':>7} {'threads':>7} {'tiles/s':>8} {'vs plain loop':>14}")
    for image_format in ("png", "jpeg"):
        base = plain_loop(index, scratch / "plain", image_format)
        print(f"{'plain loop ' + image_format:<26} {1:>7} {1:>7} {base:>8.0f} {1.0:>13.2f}x")
        for fmt in ("imagefolder", "webdataset"):
            for workers in (1, 2):
                speed, shards = ours(
                    index,
                    scratch / f"{fmt}-{image_format}",
                    format=fmt,
                    image_format=image_format,
                    shard_size=500,
                    workers=workers,
                )
                threads = threads_per_process(workers)  # export_index's default
                print(
                    f"{fmt + ' ' + image_format:<26} {workers:>7} {threads:>7} {speed:>8.0f} "
                    f"{speed / base:>13.2f}x"
                )
        sizes = [s["bytes"] / 2**20 for s in shards]
        print(
            f"  webdataset {image_format} shards of 500 tiles: "
            f"{', '.join(f'{s:.1f}' for s in sizes)} MiB"
        )

    from dask.distributed import Client, LocalCluster

    shards_of_250: dict[str, object] = dict(
        format="webdataset", image_format="jpeg", shard_size=250
    )
    local, _ = ours(index, scratch / "local", workers=2, **shards_of_250)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        ours(index, scratch / "warm", executor=client, **shards_of_250)  # worker imports
        remote, _ = ours(index, scratch / "dask", executor=client, **shards_of_250)
    print(
        f"\nwebdataset jpeg, 2 local processes: {local:.0f} tiles/s; 2-worker Dask "
        f"LocalCluster: {remote:.0f} tiles/s ({remote / local:.2f}x)"
    )


if __name__ == "__main__":
    main()
