"""How worker processes hand batches over: torch's shared memory against our ring of slots.

    .venv/bin/python benchmarks/bench_transport.py [--tiles 3000] [--rounds 7] [--workers 2]
        [--context fork] [--busy N]

Two loaders over the same random aligned 256 px tiles (batch 64), ``--workers`` worker
processes each, persistent, made once and warmed by one epoch: ``torch`` (each batch in a
reused buffer of torch's shared memory, its file descriptor passed to the consumer per batch:
the transport before `wsi_loader.dataset._transport`) and ``ring`` (the default: a slot number
per batch). Epochs are interleaved (one of each in turn, ``--rounds`` times, the order reversed
every other round). Printed per way:
tiles/s, the consumer's CPU per batch (``time.process_time`` around each ``next``, this
process), the workers' CPU per batch (from /proc), best and median over the rounds, and the
ratio ring / torch from the same run. ``--busy N``: N other processes spin on a core each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from common import random_rows_of_one_slide, scratch_folder

from wsi_loader.dataset._loader import TileLoader, make_loader
from wsi_loader.device._bench import busy_cores

TICKS = os.sysconf("SC_CLK_TCK")


def _workers_cpu(loader: TileLoader) -> float:
    """CPU seconds the loader's worker processes have used (user + system, from /proc)."""
    total = 0.0
    for worker in getattr(loader._iterator, "_workers", []):
        fields = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def one_epoch(loader: TileLoader) -> tuple[float, float, float]:
    """(tiles/s, consumer CPU s per batch, workers' CPU s per batch) of one epoch."""
    tiles = batches = 0
    consumer = 0.0
    workers = _workers_cpu(loader)
    start = time.perf_counter()
    iterator = iter(loader)
    while True:
        cpu = time.process_time()
        batch = next(iterator, None)
        consumer += time.process_time() - cpu
        if batch is None:
            break
        tiles += len(batch.images)
        batches += 1
        del batch
    wall = time.perf_counter() - start
    return tiles / wall, consumer / batches, (_workers_cpu(loader) - workers) / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--context", default="fork")
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--scratch")
    args = parser.parse_args()
    folder = scratch_folder(args.scratch, "bench-transport-")
    index, rows = random_rows_of_one_slide(folder, args.tiles)
    batches = [rows[i : i + 64] for i in range(0, len(rows), 64)]
    loaders = {}
    for way in ("torch", "ring"):
        loader = make_loader(
            index,
            batches=batches,
            num_workers=args.workers,
            multiprocessing_context=args.context,
            pin_memory=False,
        )
        loader.use_ring = way == "ring"
        loaders[way] = loader
    results: dict[str, list[tuple[float, float, float]]] = {way: [] for way in loaders}
    with busy_cores(args.busy):
        for loader in loaders.values():
            one_epoch(loader)  # workers started, page cache and buffers warm
        for n in range(args.rounds):
            order = list(loaders) if n % 2 == 0 else list(reversed(loaders))  # ABBA: no side
            for way in order:  # always second
                results[way].append(one_epoch(loaders[way]))
    print(
        f"{args.workers} {args.context} workers, batch 64 of 256 px, {args.tiles} tiles a "
        f"round, {args.rounds} rounds interleaved, {args.busy} busy; load average "
        f"{os.getloadavg()[0]:.1f}; ring fallbacks {loaders['ring'].ring_fallbacks}"
    )
    print(
        f"{'way':>6} {'tiles/s best':>12} {'median':>7} {'consumer ms/batch best':>22} "
        f"{'median':>7} {'workers ms/batch median':>23}"
    )
    summary = {}
    for way, runs in results.items():
        rate = [r[0] for r in runs]
        consumer = [r[1] * 1e3 for r in runs]
        workers = [r[2] * 1e3 for r in runs]
        summary[way] = (max(rate), statistics.median(rate), min(consumer))
        summary[way] += (statistics.median(consumer), statistics.median(workers))
        print(
            f"{way:>6} {max(rate):12.0f} {statistics.median(rate):7.0f} "
            f"{min(consumer):22.2f} {statistics.median(consumer):7.2f} "
            f"{statistics.median(workers):23.2f}"
        )
    ring, old = summary["ring"], summary["torch"]
    print(
        f"ring / torch: tiles/s {ring[0] / old[0]:.2f}x best, {ring[1] / old[1]:.2f}x median; "
        f"consumer CPU per batch {ring[2] / old[2]:.2f}x best, {ring[3] / old[3]:.2f}x median; "
        f"workers' CPU per batch {ring[4] / old[4]:.2f}x median"
    )


if __name__ == "__main__":
    main()
