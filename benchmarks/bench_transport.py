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

``--callgrind N`` counts instructions instead (independent of the machine's load): for each way
it runs this script under ``valgrind --tool=callgrind`` (needs valgrind's headers and a C
compiler for the client requests), with spawn workers (not traced), warms one epoch with the
instrumentation off, then counts the consumer's instructions inside ``next()`` for N batches,
and inside ``next()`` plus ``del batch`` (where a ring slot's lease is let go) for N more.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
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


CLIENT_REQUESTS = """
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; }
void toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void dump(void) { CALLGRIND_DUMP_STATS; }
"""


def count_in_consumer(loader: TileLoader, batches: int, requests: str) -> None:
    """Under callgrind: the consumer's instructions in ``next()`` for ``batches`` batches (the
    first dump), then in ``next()`` and ``del batch`` for as many more (the second)."""
    calls = ctypes.CDLL(requests)
    one_epoch(loader)  # workers started, buffers warm, instrumentation still off
    iterator = iter(loader)
    calls.start()
    for scope in ("next", "next+del"):
        for _ in range(batches):
            calls.toggle()
            batch = next(iterator)
            if scope == "next":
                calls.toggle()
            del batch
            if scope == "next+del":
                calls.toggle()
        calls.dump()
    for _ in iterator:
        pass


def _instructions(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError(f"no totals in {dump}")


def callgrind(args: argparse.Namespace, folder: Path) -> None:
    """Runs this script under callgrind once per way; prints instructions per batch."""
    work = Path(tempfile.mkdtemp(prefix="bench-transport-cg-"))
    (work / "requests.c").write_text(CLIENT_REQUESTS)
    requests = work / "requests.so"
    subprocess.run(
        ["cc", "-O1", "-shared", "-fPIC", "-o", requests, work / "requests.c"], check=True
    )
    per_batch = {}
    for way in ("torch", "ring"):
        out = work / f"{way}.out"
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
             "--trace-children=no", f"--callgrind-out-file={out}",
             sys.executable, __file__, "--scratch", str(folder), "--way", way,
             "--count-instructions", str(args.callgrind), "--requests", str(requests),
             "--workers", str(args.workers)],
            check=True, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        dumps = sorted(work.glob(f"{way}.out.*"), key=lambda p: int(p.suffix[1:]))
        per_batch[way] = [_instructions(d) / args.callgrind for d in dumps[:2]]
        print(
            f"{way:>6}: {per_batch[way][0] / 1e3:,.0f}k instructions per batch in next(), "
            f"{per_batch[way][1] / 1e3:,.0f}k with del batch"
        )
    ring, old = per_batch["ring"], per_batch["torch"]
    print(f"ring / torch: {ring[0] / old[0]:.2f}x in next(), {ring[1] / old[1]:.2f}x with del")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--context", default="fork")
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--scratch")
    parser.add_argument("--callgrind", type=int, default=0, metavar="BATCHES")
    parser.add_argument("--count-instructions", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--requests", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = scratch_folder(args.scratch, "bench-transport-")
    if args.callgrind:
        random_rows_of_one_slide(folder, 0)  # the slide and index, made outside valgrind
        callgrind(args, folder)
        return
    if args.count_instructions:  # 2N counted batches, and some the workers read ahead
        args.tiles, args.context = 64 * (2 * args.count_instructions + 8), "spawn"
    index, rows = random_rows_of_one_slide(folder, args.tiles)
    batches = [rows[i : i + 64] for i in range(0, len(rows), 64)]
    loaders = {}
    for way in ("torch", "ring") if args.way is None else (args.way,):
        loader = make_loader(
            index,
            batches=batches,
            num_workers=args.workers,
            multiprocessing_context=args.context,
            pin_memory=False,
        )
        loader.use_ring = way == "ring"
        loaders[way] = loader
    if args.count_instructions:
        count_in_consumer(loaders[args.way], args.count_instructions, args.requests)
        return
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
