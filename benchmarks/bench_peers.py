"""Tile loading side by side with cuCIM's own code, run the way its users run it (issue 53).

    make bench-peers            # builds .venv-peers (cucim-cu12 beside this package) and runs
    .venv-peers/bin/python benchmarks/bench_peers.py [--quick] [--tiles 2000] [--rounds 5]

Every row reads the same random aligned 256 px tissue tiles (the rows of one index built over a
synthetic 30k x 22.5k Aperio-like SVS with 256 px JPEG tiles), in the same order, batches of 64,
and every row's pixels are checked identical to the decode-only row's once, before timing:

  a. ``make_loader(index, batch_size=64)``, its defaults (what it chose is printed)
  b. ``make_loader`` with ``num_workers=0``, and with ``num_workers=2``
  c. cuCIM's batch API: ``CuImage.read_region(locations, size, level, batch_size=64,
     num_workers=2)``, one process, cuCIM's C++ thread pool
  d. a per-item cuCIM Dataset (one CuImage per worker, ``read_region`` per tile, a CHW tensor
     per tile) through ``torch.utils.data.DataLoader(batch_size=64, num_workers=2)``, default
     collate: what MONAI's CuCIMWSIReader and cuCIM's examples amount to
  e. our per-item path: ``TileDataset`` through the same plain DataLoader and default collate
  f. one pooled OpenSlide handle per worker through the same plain DataLoader
  g. the decode-only limit: the same tiles' stored JPEG bytes (tifffile offsets, the shared
     JPEG tables spliced in), already in memory, decoded by libjpeg-turbo (simplejpeg) in one
     thread into a batch buffer; its rate times the cores the other rows use (2) is the limit;
     and the same decodes on 2 threads (batches shared as make_loader's readers share them):
     what the decoder itself reaches on this machine's 2 cores

Only the index rows given to each loader differ from the defaults (``sampler=rows``). Rows with
workers keep them between rounds (``persistent_workers=True``, make_loader's default, given to
the plain DataLoaders too), fork start; one untimed round first starts them, opens every handle
and warms the page cache. A round runs every row once (the order rotated each round), and each
pass is timed from ``iter()`` to the last batch. CPU per tile is this process plus its children
(``resource.getrusage`` of self and of reaped children, plus /proc of live workers), so threads
and worker processes count alike. The rounds run once idle, then once while a busy-loop process
started here keeps one other core busy.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import openslide
import simplejpeg
import tifffile
import torch
from common import scratch_folder, synthetic_slide
from torch.utils.data import DataLoader, Dataset

from wsi_loader.dataset import TileDataset, make_loader
from wsi_loader.device._bench import busy_cores
from wsi_loader.index import SlideIndex, build_index

try:
    from cucim import CuImage
except ImportError as exc:  # cuCIM is no dependency of ours: `make bench-peers` installs it
    raise SystemExit(
        f"cuCIM is not importable ({exc}); run `make bench-peers`, which builds .venv-peers with "
        "cucim-cu12 beside this package"
    ) from exc

BATCH = 64
WORKERS = 2  # the worker processes or threads of every peer row, and the decode limit's cores
Pass = Callable[[list[np.ndarray] | None], int]  # reads every tile once; returns tiles read


# -- CPU time of this process and its children -------------------------------------------------


def _children() -> list[int]:
    """Live child processes of this one (DataLoader workers), from /proc."""
    me, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry.name))
    return found


def _proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(exclude: set[int]) -> float:
    """User + system seconds of this process, its reaped children and its live children
    (persistent workers never exit between rounds), less the ``exclude``d (the busy loop)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total + sum(_proc_cpu(pid) for pid in _children() if pid not in exclude)


# -- the rows ------------------------------------------------------------------------------------


def _nhwc(images: torch.Tensor) -> np.ndarray:
    return images.permute(0, 2, 3, 1).numpy().copy()


def loader_pass(loader: Any) -> Pass:
    """One epoch of ``loader``: `TileBatch` objects (make_loader) or collated dicts with CHW
    ``image`` (a plain DataLoader)."""

    def run(collect: list[np.ndarray] | None) -> int:
        seen = 0
        for batch in loader:
            if isinstance(batch, dict):
                seen += len(batch["image"])
                if collect is not None:
                    collect.append(_nhwc(batch["image"]))
            else:
                seen += len(batch.images)
                if collect is not None:
                    collect.append(batch.images.numpy().copy())
        return seen

    return run


def cucim_batch_pass(path: str, locations: np.ndarray, size: int) -> Pass:
    """cuCIM's batch reader as its docs show it: one call over every location, batches of 64
    decoded by its own thread pool, each batch one (N, H, W, 3) array."""
    image = CuImage(path)

    def run(collect: list[np.ndarray] | None) -> int:
        seen = 0
        for batch in image.read_region(
            locations, (size, size), 0, batch_size=BATCH, num_workers=WORKERS
        ):
            pixels = np.asarray(batch)
            seen += len(pixels)
            if collect is not None:
                collect.append(pixels[..., :3].copy())
        return seen

    return run


class CuCIMTiles(Dataset[dict[str, Any]]):
    """Per-item cuCIM reads: one CuImage per worker process (opened there, never inherited),
    ``read_region`` per tile, a CHW tensor per tile (as MONAI's CuCIMWSIReader hands over)."""

    def __init__(self, path: str, xs: np.ndarray, ys: np.ndarray, size: int) -> None:
        self.path, self.xs, self.ys, self.size = path, xs.tolist(), ys.tolist(), size
        self.image: Any = None

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.image is None:
            self.image = CuImage(self.path)
        region = np.asarray(self.image.read_region((self.xs[i], self.ys[i]), (self.size,) * 2, 0))
        return {"image": torch.from_numpy(region).permute(2, 0, 1), "x": self.xs[i]}


class PooledOpenSlideTiles(Dataset[dict[str, Any]]):
    """One OpenSlide handle per worker process, per-item CHW tensors (the usual good Dataset)."""

    def __init__(self, path: str, xs: np.ndarray, ys: np.ndarray, size: int) -> None:
        self.path, self.xs, self.ys, self.size = path, xs.tolist(), ys.tolist(), size
        self.slide: openslide.OpenSlide | None = None

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.slide is None:
            self.slide = openslide.OpenSlide(self.path)
        rgba = np.asarray(self.slide.read_region((self.xs[i], self.ys[i]), 0, (self.size,) * 2))
        return {"image": torch.from_numpy(rgba[..., :3].copy()).permute(2, 0, 1), "x": self.xs[i]}


def plain_loader(dataset: Dataset[Any], sampler: Any = None) -> DataLoader[Any]:
    return DataLoader(
        dataset,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=WORKERS,
        persistent_workers=True,
        multiprocessing_context="fork",
    )


def stored_streams(path: str, xs: np.ndarray, ys: np.ndarray) -> tuple[list[bytes], int]:
    """Each tile's stored JPEG segment with the level's shared tables spliced in: one complete
    stream per tile (the synthetic slide's JPEGs are YCbCr, so no Adobe marker is needed)."""
    with tifffile.TiffFile(path) as tif:
        page = tif.pages.first
        assert page.photometric == tifffile.PHOTOMETRIC.YCBCR, "only YCbCr JPEG tiles"
        size, across = page.tilewidth, -(-page.imagewidth // page.tilewidth)
        head = page.jpegtables[:-2]  # without its EOI
        streams = []
        for x, y in zip(xs.tolist(), ys.tolist(), strict=True):
            i = (y // size) * across + x // size
            tif.filehandle.seek(page.dataoffsets[i])
            streams.append(head + tif.filehandle.read(page.databytecounts[i])[2:])  # less SOI
    return streams, size


def decode_pass(streams: list[bytes], size: int) -> Pass:
    buffer = np.empty((BATCH, size, size, 3), dtype=np.uint8)

    def run(collect: list[np.ndarray] | None) -> int:
        for start in range(0, len(streams), BATCH):
            part = streams[start : start + BATCH]
            for k, stream in enumerate(part):
                simplejpeg.decode_jpeg(stream, colorspace="RGB", buffer=buffer[k])
            if collect is not None:
                collect.append(buffer[: len(part)].copy())
        return len(streams)

    return run


def decode_threads_pass(streams: list[bytes], size: int, pool: ThreadPoolExecutor) -> Pass:
    """The decode-only row on ``pool``'s threads: batch ``k`` on thread ``k % threads`` (as
    make_loader's reader threads share batches), each into a buffer of its own. What the
    decoder itself reaches on this machine's cores, beside the limit that assumes it scales
    perfectly."""
    threads = pool._max_workers
    buffers = [np.empty((BATCH, size, size, 3), dtype=np.uint8) for _ in range(threads)]
    starts = list(range(0, len(streams), BATCH))

    def decode_share(k: int) -> None:
        for start in starts[k::threads]:
            for n, stream in enumerate(streams[start : start + BATCH]):
                simplejpeg.decode_jpeg(stream, colorspace="RGB", buffer=buffers[k][n])

    def run(collect: list[np.ndarray] | None) -> int:
        if collect is not None:  # (the pixels are the one-thread row's; checked there)
            decode_pass(streams, size)(collect)
            return len(streams)
        for future in [pool.submit(decode_share, k) for k in range(threads)]:
            future.result()
        return len(streams)

    return run


# -- measuring -----------------------------------------------------------------------------------


def check_pixels(passes: dict[str, Pass], reference: str) -> None:
    """Every row once, its pixels against the reference row's, tile by tile."""
    pixels: dict[str, np.ndarray] = {}
    for name, one_pass in passes.items():
        collect: list[np.ndarray] = []
        one_pass(collect)
        pixels[name] = np.concatenate(collect)
    want = pixels[reference]
    for name, got in pixels.items():
        if got.shape != want.shape:
            raise SystemExit(f"row {name}: pixels of shape {got.shape}, expected {want.shape}")
        differ = np.flatnonzero((got != want).reshape(len(got), -1).any(axis=1))
        if len(differ):
            worst = int(np.abs(got.astype(np.int16) - want).max())
            raise SystemExit(
                f"row {name}: {len(differ)} of {len(got)} tiles differ from {reference} "
                f"(first at tile {differ[0]}, largest difference {worst})"
            )
    print(f"pixels: all {len(passes)} rows identical on {len(want)} tiles")


def measure(
    passes: dict[str, Pass], rounds: int, tiles: int, exclude: set[int]
) -> dict[str, list[tuple[float, float]]]:
    """``rounds`` interleaved rounds; per row, (tiles/s, CPU us per tile) of each pass."""
    names = list(passes)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cpu, start = cpu_seconds(exclude), time.perf_counter()
            seen = passes[name](None)
            wall, used = time.perf_counter() - start, cpu_seconds(exclude) - cpu
            if seen != tiles:
                raise SystemExit(f"row {name} read {seen} tiles, expected {tiles}")
            results[name].append((seen / wall, used / seen * 1e6))
    return results


LABELS = {
    "a": "a. make_loader defaults",
    "b0": "b. make_loader num_workers=0",
    "b2": "b. make_loader num_workers=2",
    "c": "c. cuCIM batch API, 2 threads",
    "d": "d. cuCIM per item, DataLoader 2 w.",
    "e": "e. TileDataset per item, DL 2 w.",
    "f": "f. pooled OpenSlide, DataLoader 2 w.",
    "g1": "g. decode only, 1 thread",
    "g": f"g. decode limit (1 thread x {WORKERS})",
    "g2": f"g. decode only, {WORKERS} threads",
}


def report(
    results: dict[str, list[tuple[float, float]]], title: str, load: str
) -> dict[str, float]:
    """Print the table; return the targets' ratios (best and median)."""
    rows = dict(results)
    rows["g"] = [(rate * WORKERS, cpu) for rate, cpu in results["g1"]]
    best = {name: max(rate for rate, _ in runs) for name, runs in rows.items()}
    median = {name: statistics.median(rate for rate, _ in runs) for name, runs in rows.items()}
    print(f"\n## {title}: {len(results['a'])} rounds, {load}")
    print(f"{'row':<38} {'best':>7} {'median':>7} {'CPU us':>7}  make_loader defaults vs row")
    for name, label in LABELS.items():
        cpu = statistics.median(cpu for _, cpu in rows[name])
        vs = (
            ""
            if name == "a"
            else f"{best['a'] / best[name]:.2f}x / {median['a'] / median[name]:.2f}x"
        )
        print(f"{label:<38} {best[name]:7.0f} {median[name]:7.0f} {cpu:7.0f}  {vs}")
    targets = {}
    for label, ours, peer, goal in (
        ("make_loader defaults / cuCIM batch API", "a", "c", 1.3),
        ("make_loader defaults / decode limit", "a", "g", 0.8),
        ("make_loader defaults / decode on 2 threads", "a", "g2", None),
        ("per item: TileDataset / cuCIM per item", "e", "d", 1.2),
    ):
        b, m = best[ours] / best[peer], median[ours] / median[peer]
        if goal is None:  # no target: how much of what the decoder reaches here
            print(f"{label}: {b:.2f}x best, {m:.2f}x median")
        else:
            met = "met" if min(b, m) >= goal else "NOT met"
            print(f"target {label} >= {goal}x: {b:.2f}x best, {m:.2f}x median: {met}")
        targets[label] = m
    return targets


def load_average() -> str:
    """The machine's 1-minute load average as the phase starts (other jobs on the machine)."""
    return f"load average {os.getloadavg()[0]:.1f} at its start"


def describe(loader: Any, log: list[str]) -> str:
    """What make_loader chose: its workers, and whatever it logged while choosing."""
    chose = f"{type(loader).__name__}, num_workers={getattr(loader, 'num_workers', None)!r}"
    for attribute in ("threads", "decode_threads", "mode", "chosen", "choice"):
        if hasattr(loader, attribute):
            chose += f", {attribute}={getattr(loader, attribute)!r}"
    return chose + "".join(f"; logged: {line}" for line in log)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def loaders(index: SlideIndex, rows: np.ndarray) -> Iterator[tuple[str, Any, str]]:
    collect = _Collect()
    package = logging.getLogger("wsi_loader")
    level = package.level
    package.addHandler(collect)
    package.setLevel(logging.INFO)
    try:
        default = make_loader(index, batch_size=BATCH, sampler=rows.tolist())
    finally:
        package.removeHandler(collect)
        package.setLevel(level)
    yield "a", default, describe(default, collect.lines)
    for workers in (0, WORKERS):
        loader = make_loader(index, batch_size=BATCH, sampler=rows.tolist(), num_workers=workers)
        yield f"b{workers}", loader, describe(loader, [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiles", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per phase")
    parser.add_argument("--width", type=int, default=30_000, help="synthetic slide width (4:3)")
    parser.add_argument("--scratch", help="folder kept between runs (the slide is written once)")
    parser.add_argument("--quick", action="store_true", help="640 tiles, 2 rounds: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.tiles, args.rounds = 640, 2

    scratch = scratch_folder(args.scratch, "wsi-bench-peers-")
    started = time.perf_counter()
    slide = synthetic_slide(scratch / f"peers-{args.width}.svs", width=args.width, seed=53)
    index = build_index(
        [slide], scratch / f"index-{args.width}", tile_size=256, level=0, min_tissue=0.5
    )
    size = 256
    rng = np.random.default_rng(53)
    if len(index) < args.tiles:
        raise SystemExit(f"the index has {len(index)} tissue tiles, fewer than --tiles")
    rows = rng.choice(len(index), size=args.tiles, replace=False).astype(np.int64)
    xs = np.asarray(index.columns["l0_x"][rows], dtype=np.int64)
    ys = np.asarray(index.columns["l0_y"][rows], dtype=np.int64)
    path = index.slide_path(0)
    streams, stored = stored_streams(path, xs, ys)
    assert stored == size, f"the slide's storage tiles are {stored} px, not {size}"
    print(
        f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{len(os.sched_getaffinity(0))} usable cores, torch {torch.__version__}, "
        f"cuCIM {__import__('cucim').__version__}, openslide {openslide.__library_version__}"
    )
    print(
        f"# slide {args.width} x {args.width * 3 // 4} synthetic SVS ({len(index)} tissue tiles),"
        f" {args.tiles} random aligned {size} px tiles, batch {BATCH}; set-up "
        f"{time.perf_counter() - started:.0f} s"
    )

    passes: dict[str, Pass] = {}
    # worker rows first: their persistent workers fork before this process uses cuCIM
    for name, loader, chose in loaders(index, rows):
        passes[name] = loader_pass(loader)
        if name == "a":
            print(f"make_loader(index, batch_size=64) chose: {chose}")
    passes["d"] = loader_pass(plain_loader(CuCIMTiles(path, xs, ys, size)))
    passes["e"] = loader_pass(plain_loader(TileDataset(index), sampler=rows.tolist()))
    passes["f"] = loader_pass(plain_loader(PooledOpenSlideTiles(path, xs, ys, size)))
    warm = list(passes.values())
    for one_pass in warm:  # starts the workers, opens the handles, warms the page cache
        one_pass(None)
    # cuCIM takes int64 locations only as C long long ("Expected int64 array-like" for np.int64)
    passes["c"] = cucim_batch_pass(path, np.stack([xs, ys], axis=1).astype(np.longlong), size)
    passes["g1"] = decode_pass(streams, size)
    passes["g2"] = decode_threads_pass(streams, size, ThreadPoolExecutor(WORKERS))
    check_pixels(passes, reference="g1")

    before = load_average()
    idle = report(measure(passes, args.rounds, args.tiles, set()), "idle", before)
    with busy_cores(1) as spinners:
        before = load_average()
        results = measure(passes, args.rounds, args.tiles, {s.pid for s in spinners})
        busy = report(results, "one other core busy (a busy-loop process)", before)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; median ratios, idle / busy:")
    for label in idle:
        print(f"  {label}: {idle[label]:.2f}x / {busy[label]:.2f}x")


if __name__ == "__main__":
    main()
