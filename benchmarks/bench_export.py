"""Export throughput per format against the plain loop (OpenSlide read_region + PIL save), shard
sizes, and a 2-worker Dask LocalCluster against local processes, all in one run. Local exports
read and encode on usable cores / workers threads (the ``threads`` column).

The shuffle section exports 6 slides (768 tiles each) to WebDataset shards with and without
``--shuffle`` and reads them back as a trainer does: shards in order through a 1,000-sample
shuffle buffer (webdataset's ``shuffle(1000)``), counting distinct slides per shard and per
64-sample batch.

    .venv/bin/python benchmarks/bench_export.py [--tiles 1500] [--scratch DIR] [--only-shuffle]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tarfile
import time
from pathlib import Path

import numpy as np
import openslide
from common import scratch_folder, synthetic_slide

from wsi_loader.dataset._cores import threads_per_process
from wsi_loader.export import export_index
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index._table_writer import write_index


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


def buffered(items: list[int], size: int, seed: int) -> list[int]:
    """Items through a shuffle buffer of ``size``, as webdataset's ``shuffle(size)`` does:
    fill the buffer, then emit a random buffered item for every new one."""
    rng = np.random.default_rng(seed)
    buffer: list[int] = []
    out: list[int] = []
    for item in items:
        buffer.append(item)
        if len(buffer) >= size:
            out.append(buffer.pop(int(rng.integers(len(buffer)))))
    while buffer:
        out.append(buffer.pop(int(rng.integers(len(buffer)))))
    return out


def shard_slide_ids(out: Path) -> list[int]:
    """The slide id of every sample, reading the shards in order."""
    ids = []
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    handle = tar.extractfile(member)
                    assert handle is not None
                    ids.append(int(json.loads(handle.read())["slide_id"]))
    return ids


def shuffle_section(scratch: Path, slides: int = 6) -> None:
    folder = scratch / "archive"
    folder.mkdir(exist_ok=True)
    source = synthetic_slide(scratch / "medium.svs", width=8192, seed=5)
    for i in range(slides):
        target = folder / f"slide{i:02d}.svs"
        if not target.exists():
            os.link(source, target)
    index = build_index([folder], scratch / "archive-idx", tile_size=256, level=0, min_tissue=0)
    print(f"\n## shuffle: {slides} slides, {len(index)} tiles, shards of 250, buffer 1000")
    print(f"{'export':<16} {'slides/shard':>13} {'slides/64-batch':>16} {'tiles/s':>8}")
    for shuffle in (False, True):
        out = scratch / f"wds-shuffle-{shuffle}"
        speed, shards = ours(
            index,
            out,
            format="webdataset",
            image_format="jpeg",
            shard_size=250,
            workers=2,
            shuffle=shuffle,
            seed=0,
        )
        per_shard = np.mean([s["slides"] for s in shards])
        stream = buffered(shard_slide_ids(out), 1000, seed=0)
        per_batch = np.mean([len(set(stream[i : i + 64])) for i in range(0, len(stream) - 63, 64)])
        name = "--shuffle" if shuffle else "index order"
        print(f"{name:<16} {per_shard:>13.1f} {per_batch:>16.1f} {speed:>8.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiles", type=int, default=1500)
    parser.add_argument("--scratch")
    parser.add_argument("--only-shuffle", action="store_true", help="run the shuffle section")
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-bench-export-")
    if args.only_shuffle:
        shuffle_section(scratch)
        return
    slide = synthetic_slide(scratch / "slide.svs", seed=9)
    labels = scratch / "labels.csv"  # image folders hold labelled tiles only
    labels.write_text("slide,label\nslide,tissue\n")
    full = build_index(
        [slide], scratch / "full", tile_size=256, level=0, min_tissue=0.5, labels=str(labels)
    )
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
    shuffle_section(scratch)


if __name__ == "__main__":
    main()
