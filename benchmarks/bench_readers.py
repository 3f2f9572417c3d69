"""Threads or processes: what `make_loader(num_workers="auto")` chooses, against the others.

    .venv/bin/python benchmarks/bench_readers.py [--tiles 2000] [--rounds 5] [--busy N]

The same random aligned 256 px tiles (batch 64) read by `make_loader` three ways, each a fresh
loader per pass (start-up included, as a script's first epoch; the first batch's wait is
printed apart): ``auto`` (what the default chooses here), ``workers=N`` (one worker process per
usable core, the default before "auto"), ``workers=0`` (read in the consumer's thread when
asked for). Two consumers: ``none`` (takes the batches and does nothing: the reading rate
alone) and ``model`` (a small CNN forward pass on every batch on the CPU, torch's threads
included: a consumer that wants the cores too). Passes are interleaved (every way in turn,
``--rounds`` times); best and median tiles/s, CPU per tile (this process and its children),
and ratios to ``auto`` from the same run. ``--busy N``: N other processes spin on a core each.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch
from common import random_rows_of_one_slide, scratch_folder

from wsi_loader.dataset import make_loader
from wsi_loader.dataset._cores import usable_cores
from wsi_loader.device._bench import busy_cores
from wsi_loader.index import SlideIndex


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _consumer(name: str) -> Callable[[torch.Tensor], None]:
    if name == "none":
        return lambda images: None
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 7, stride=4),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2),
        torch.nn.AdaptiveAvgPool2d(1),
    ).eval()

    def forward(images: torch.Tensor) -> None:
        with torch.no_grad():
            model(images.permute(0, 3, 1, 2).float())

    return forward


def one_pass(
    index: SlideIndex, rows: list[int], workers: int | str, consume: Callable[..., None]
) -> tuple[float, float, float]:
    """(tiles/s, CPU seconds per tile, seconds to the first batch) of one fresh loader."""
    batches = [rows[i : i + 64] for i in range(0, len(rows), 64)]
    cpu, start = _cpu_seconds(), time.perf_counter()
    loader = make_loader(index, batches=batches, num_workers=workers, persistent_workers=False)
    first = None
    tiles = 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
        consume(batch.images)
        tiles += len(batch.images)
    wall = time.perf_counter() - start
    assert tiles == len(rows)
    return tiles / wall, (_cpu_seconds() - cpu) / tiles, first or 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--scratch")
    args = parser.parse_args()
    folder = scratch_folder(args.scratch, "bench-readers-")
    index, rows = random_rows_of_one_slide(folder, args.tiles)
    cores = usable_cores()
    chosen = make_loader(index, batch_size=64).readers
    print(f"{cores} usable cores, {args.busy} busy; auto chooses: {chosen}")
    ways: list[int | str] = ["auto", cores, 0]
    with busy_cores(args.busy):
        for consumer in ("none", "model"):
            consume = _consumer(consumer)
            results: dict[str, list[tuple[float, float, float]]] = {str(w): [] for w in ways}
            one_pass(index, rows[:256], "auto", consume)  # warm the page cache and imports
            for _ in range(args.rounds):
                for way in ways:
                    results[str(way)].append(one_pass(index, rows, way, consume))
            auto_best = max(r[0] for r in results["auto"])
            print(f"\nconsumer: {consumer}")
            print(
                f"{'readers':>10} {'best':>7} {'median':>7} {'us CPU/tile':>11} "
                f"{'first ms':>8} {'auto / this':>11}"
            )
            for way in ways:
                runs = results[str(way)]
                best = max(r[0] for r in runs)
                label = "auto" if way == "auto" else f"workers={way}"
                print(
                    f"{label:>10} {best:7.0f} {statistics.median(r[0] for r in runs):7.0f} "
                    f"{statistics.median(r[1] for r in runs) * 1e6:11.0f} "
                    f"{statistics.median(r[2] for r in runs) * 1e3:8.0f} "
                    f"{auto_best / best:11.2f}"
                )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
