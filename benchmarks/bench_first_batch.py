"""First batch: from ``iter(make_loader(index, batch_size=64))`` to the first batch in hand.

    .venv/bin/python benchmarks/bench_first_batch.py [--rounds 5] [--scratch DIR]

Each setting runs in a fresh Python process per round (so nothing is warm: no worker, no open
slide, no buffer), which imports wsi_loader, opens the index and makes the loader before the
clock starts, as a training script has done by then. The clock runs from ``iter(loader)`` to
the first batch in hand (issue 53, item 5). Its parts are timed by wrapping library functions
from here (nothing in the library times itself), in whichever process runs them:

- start: from ``iter`` to the worker's ``worker_init_fn`` (process start; for spawn and
  forkserver also the imports and the dataset's unpickling), 0 with num_workers=0;
- buffer: the first batch buffer (``BufferRing.take``: allocation, shared memory in workers);
- open: the first slide opened (``open_slide``: file and TIFF parse);
- verify: the check that the file is the slide indexed (content digest of head and tail);
- decode: the rest of the first ``read_batch`` (reading and decoding 64 tiles);
- hand-over: from the worker's batch ready to the batch in the main process.

With several workers the parts are those of the worker whose batch came first. Prints the
median over rounds of each part, in ms. ``--baseline DIR`` (a checkout holding wsi_loader/,
e.g. ``git archive COMMIT wsi_loader | tar -x -C DIR``) adds its rows, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SETTINGS = {
    "default": {},
    "0 workers": {"num_workers": 0},
    "2 workers, fork": {"num_workers": 2, "multiprocessing_context": "fork"},
    "2 workers, spawn": {"num_workers": 2, "multiprocessing_context": "spawn"},
}
EVENTS = os.environ.get("FIRST_BATCH_EVENTS", "")


def note(name: str, start: float, end: float) -> None:
    """One timed part, appended to the events file (one line, atomic for small writes)."""
    line = json.dumps({"pid": os.getpid(), "part": name, "start": start, "end": end}) + "\n"
    with open(EVENTS, "a") as f:
        f.write(line)


def timed_calls() -> None:
    """Wrap the library functions of the parts, in this process (forked workers inherit it;
    spawned ones call it from `init_worker`)."""
    from wsi_loader.dataset import _buffers, _reading, _tiles
    from wsi_loader.slides import _pool

    def wrap(owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                note(part, start, time.monotonic())

        setattr(owner, name, timed)

    wrap(_buffers.BufferRing, "take", "buffer")
    wrap(_pool, "open_slide", "open")
    wrap(_reading.TileReader, "_verify", "verify")
    wrap(_tiles.TileDataset, "read_batch", "read_batch")


def init_worker(worker_id: int, **kwargs: Any) -> None:
    note("start", time.monotonic(), time.monotonic())
    if sys.modules["wsi_loader.dataset._buffers"].BufferRing.take.__name__ != "timed":
        timed_calls()  # a spawned worker: a fresh interpreter
    from wsi_loader.dataset._worker_exit import start_worker

    start_worker(worker_id, **kwargs)


def one_round(index_path: str, setting: str) -> dict[str, float]:
    """In a fresh process: the first batch of one loader, and its parts (ms)."""
    from functools import partial

    from wsi_loader.dataset import _loader, make_loader

    timed_calls()
    original = _loader.partial

    def init_partial(fn: Any, **kwargs: Any) -> Any:  # make_loader's worker_init_fn
        if fn is _loader.start_worker:
            return partial(init_worker, **kwargs)
        return original(fn, **kwargs)

    _loader.partial = init_partial  # type: ignore[assignment]
    loader = make_loader(index_path, batch_size=64, **SETTINGS[setting])  # type: ignore[arg-type]
    start = time.monotonic()
    iterator = iter(loader)
    batch = next(iterator)
    end = time.monotonic()
    assert len(batch.images) == 64
    events = [json.loads(line) for line in Path(EVENTS).read_text().splitlines()]
    # the parts of the process whose read_batch ended first
    reads = [e for e in events if e["part"] == "read_batch"]
    first = min(reads, key=lambda e: e["end"])
    mine = [e for e in events if e["pid"] == first["pid"]]

    def took(part: str) -> float:
        found = [e for e in mine if e["part"] == part]
        return (found[0]["end"] - found[0]["start"]) * 1e3 if found else 0.0

    started = [e["start"] for e in mine if e["part"] == "start"]
    parts = {
        "total": (end - start) * 1e3,
        "start": (started[0] - start) * 1e3 if started else 0.0,
        "buffer": took("buffer"),
        "open": took("open"),
        "verify": took("verify"),
    }
    parts["decode"] = took("read_batch") - parts["buffer"] - parts["open"] - parts["verify"]
    parts["hand-over"] = (end - first["end"]) * 1e3
    parts["other"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
    del iterator, loader
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=20_000, help="synthetic slide width")
    parser.add_argument("--scratch", help="folder for the slide and index (kept)")
    parser.add_argument(
        "--baseline",
        help="another checkout of wsi_loader (a folder holding wsi_loader/): its rows are "
        "interleaved with this one's, marked 'before'",
    )
    parser.add_argument("--one", nargs=2, metavar=("INDEX", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_round(*args.one)))
        return

    sys.path.insert(0, str(Path(__file__).parent))
    from common import scratch_folder, synthetic_slide

    from wsi_loader.index import build_index

    scratch = scratch_folder(args.scratch, "bench_first_batch_")
    slide = synthetic_slide(scratch / f"slide_{args.width}.svs", width=args.width)
    folder = scratch / f"index_{args.width}"
    if not folder.exists():
        build_index([slide], folder, tile_size=256, level=0, min_tissue=0.5)
    here = str(Path(__file__).resolve().parent.parent)
    checkouts = {"": here, " (before)": args.baseline} if args.baseline else {"": here}
    rows = [name + mark for name in SETTINGS for mark in checkouts]
    results: dict[str, list[dict[str, float]]] = {row: [] for row in rows}
    for _ in range(args.rounds):
        for name in SETTINGS:  # interleaved: a slow spell hits every setting alike
            for mark, checkout in checkouts.items():
                events = scratch / "events.jsonl"
                events.unlink(missing_ok=True)
                run = subprocess.run(
                    [sys.executable, __file__, "--one", str(folder), name],
                    check=True,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "FIRST_BATCH_EVENTS": str(events), "PYTHONPATH": checkout},
                    timeout=300,
                )
                results[name + mark].append(json.loads(run.stdout.splitlines()[-1]))
    parts = list(results[rows[0]][0])
    print(
        f"first batch of make_loader(index, batch_size=64), {args.width} px synthetic SVS, "
        f"median of {args.rounds} fresh processes per setting, ms; "
        f"load average at the end {os.getloadavg()[0]:.1f}"
    )
    print(f"{'setting':<27}" + "".join(f"{p:>10}" for p in parts))
    for name, rounds in results.items():
        medians = [statistics.median(r[p] for r in rounds) for p in parts]
        print(f"{name:<27}" + "".join(f"{m:10.1f}" for m in medians))


if __name__ == "__main__":
    main()
