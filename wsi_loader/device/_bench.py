"""Throughput measurements on the user's own slides and storage (``wsi-loader bench``).

Every number is measured in the same run as its baseline, so ratios are meaningful on a noisy
machine: OpenSlide ``read_region`` with a long-lived handle per slide (the baseline), the naive
pattern that opens a handle per item, our reader in one process with one decode thread, and
`make_loader` through a DataLoader with a worker sweep, each reading process with its default
decode threads (``threads`` in the output). With a device, `DeviceLoader` feeds a simulated
model step and the share of time the device waited for data is reported, with the workers
decoding JPEG and with the decode left to the device (`make_loader(decode="device")`).
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import openslide
import torch

from wsi_loader.dataset._buffers import BufferRing
from wsi_loader.dataset._cores import threads_per_process
from wsi_loader.dataset._loader import make_loader
from wsi_loader.dataset._tiles import TileDataset
from wsi_loader.device._devices import resolve_device
from wsi_loader.device._loader import DeviceLoader
from wsi_loader.index._table import SlideIndex
from wsi_loader.slides.storage._local_copies import LocalCopies
from wsi_loader.slides.storage._sources import is_url


@dataclass
class Measurement:
    name: str
    workers: int
    tiles: int
    seconds: float
    threads: int = 1  # decode threads per reading process
    cpu_seconds: float = 0.0  # CPU time of every process of the path, workers included

    @property
    def tiles_per_s(self) -> float:
        return self.tiles / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_tile(self) -> float:
        return self.cpu_seconds / self.tiles * 1e6 if self.tiles else 0.0


def process_tree_cpu() -> float:
    """CPU time of this process and of its children that have exited and been waited for
    (DataLoader workers without ``persistent_workers`` are joined at the end of the epoch)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


# a spinning process that ends on its own when the process that started it is gone
_SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


@contextmanager
def busy_cores(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes spinning on a core each for the duration (a training machine is
    never idle: the training loop, other jobs); stopped, and waited for, on the way out."""
    if count < 0:
        raise ValueError(f"busy must be >= 0, got {count}")
    spinners = [
        subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        time.sleep(0.2 if spinners else 0)  # let them reach their loop
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def sample_rows(index: SlideIndex, count: int, seed: int) -> np.ndarray:
    """``count`` random rows, the sequence every path reads: distinct rows when the index has
    that many, otherwise whole shuffles of the index one after another (each row read about
    equally often), so that no path reads from warmer caches than another."""
    rng = np.random.default_rng(seed)
    if count <= len(index):
        return rng.choice(len(index), size=count, replace=False).astype(np.int64)
    rounds = -(-count // len(index))
    return np.concatenate([rng.permutation(len(index)) for _ in range(rounds)])[:count]


def _timed(fn: Callable[[], int]) -> tuple[int, float, float]:
    """Tiles read, wall seconds, CPU seconds."""
    start, cpu = time.perf_counter(), time.process_time()
    tiles = fn()
    return tiles, time.perf_counter() - start, time.process_time() - cpu


def openslide_baseline(
    index: SlideIndex,
    rows: np.ndarray,
    reopen: bool = False,
    copies: LocalCopies | None = None,
) -> Measurement:
    """OpenSlide read_region per tile; ``reopen`` opens a new handle for every tile.

    OpenSlide reads local files only: slides at URLs are read from whole local copies
    (``copies``, downloaded before the clock starts), as an OpenSlide user would have to."""
    cols = index.columns
    handles: dict[int, openslide.OpenSlide] = {}
    paths = {sid: index.slide_path(sid) for sid in np.unique(cols["slide_id"][rows]).tolist()}
    remote = any(is_url(p) for p in paths.values())
    if remote:
        copies = copies if copies is not None else LocalCopies()
        paths = {sid: copies.local(p) if is_url(p) else p for sid, p in paths.items()}

    def run() -> int:
        for row in rows.tolist():
            sid = int(cols["slide_id"][row])
            size = int(cols["read_size"][row])
            slide = handles.get(sid)
            if slide is None:
                slide = openslide.OpenSlide(paths[sid])
                if not reopen:
                    handles[sid] = slide
            try:
                region = slide.read_region(
                    (int(cols["l0_x"][row]), int(cols["l0_y"][row])),
                    int(cols["level"][row]),
                    (size, size),
                )
                np.asarray(region)[..., :3].copy()
            except openslide.OpenSlideError:  # a bad tile latches the handle: drop it
                handles.pop(sid, None)
                slide.close()
                continue
            if reopen:
                slide.close()
        return len(rows)

    tiles, seconds, cpu = _timed(run)
    for slide in handles.values():
        slide.close()
    name = ("openslide-naive" if reopen else "openslide") + (" (local copy)" if remote else "")
    return Measurement(name, 0, tiles, seconds, cpu_seconds=cpu)


def reader_single_process(
    index: SlideIndex, rows: np.ndarray, batch_size: int, ranges: dict[str, Any] | None = None
) -> Measurement:
    """Batches read in this process, into reused buffers (what make_loader does), with one
    decode thread: the per-core rate, comparable with the OpenSlide baseline's one thread.
    For remote slides, ``ranges`` receives the range store's counters of this pass and of a
    second pass over the same rows (what a second epoch asks of the store)."""
    ds = TileDataset(index, record_failures=False, decode_threads=1)
    buffers = BufferRing()
    ds.read_batch(rows[: min(8, len(rows))].tolist())  # open handles outside the timing

    def run() -> int:
        for i in range(0, len(rows), batch_size):
            ds.read_batch(rows[i : i + batch_size].tolist(), buffers=buffers)
        return len(rows)

    store = ds.reader.pool.store
    first = store.stats()
    tiles, seconds, cpu = _timed(run)
    if ranges is not None and ds.reader.remote:
        second = store.stats()
        run()
        third = store.stats()
        ranges.update(
            budget_mb=store.max_bytes / 2**20,
            passes=[_range_pass(first, second, tiles), _range_pass(second, third, tiles)],
        )
    return Measurement("wsi_loader", 0, tiles, seconds, cpu_seconds=cpu)


def _range_pass(before: dict[str, int], after: dict[str, int], tiles: int) -> dict[str, float]:
    change = {k: after[k] - before[k] for k in after}
    return {
        "gets_per_tile": round(change["requests"] / tiles, 3),
        "kb_per_tile": round(change["bytes_fetched"] / tiles / 1e3, 1),
        "hit_rate": round(change["hits"] / change["reads"], 3) if change["reads"] else 0.0,
        "hedged": change["hedged"],
    }


def loader_run(
    index: SlideIndex,
    rows: np.ndarray,
    workers: int,
    batch_size: int,
    device: str | None = None,
    step_ms: float = 0.0,
    decode: str = "cpu",
) -> tuple[Measurement, float]:
    """Tiles/s through make_loader (and DeviceLoader when ``device``) over ``rows``, after one
    untimed batch that starts the workers; returns the share of time the consumer waited.
    The CPU time covers the whole run, worker start-up and the untimed batch included (the
    workers are only counted once they have exited), per tile of the whole run."""
    loader = make_loader(
        index,
        sampler=np.concatenate([rows[:batch_size], rows]).tolist(),
        batch_size=batch_size,
        num_workers=workers,
        record_failures=False,
        pin_memory=device == "cuda",
        persistent_workers=False,
        decode=decode,
    )
    threads = threads_per_process(workers)  # TileDataset's default
    source: Any = DeviceLoader(loader, device) if device else loader
    step = _model_step(device, step_ms)
    cpu = process_tree_cpu()
    iterator = iter(source)
    next(iterator)  # worker start-up is not throughput
    if isinstance(source, DeviceLoader):
        source.wait_seconds = 0.0
    seen, start = 0, time.perf_counter()
    for batch in iterator:
        seen += len(batch["image"]) if isinstance(batch, dict) else len(batch)
        step(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del iterator  # the workers exit (and are waited for) before the CPU time is read
    used = (process_tree_cpu() - cpu) * seen / (seen + min(batch_size, len(rows)))
    waited = source.wait_seconds / seconds if isinstance(source, DeviceLoader) else 0.0
    name = f"make_loader+{device}" if device else "make_loader"
    return Measurement(name, workers, seen, seconds, threads, used), waited


def _model_step(device: str | None, step_ms: float) -> Callable[[Any], None]:
    """A stand-in for a forward/backward pass that keeps the device busy ``step_ms``."""
    if not device or step_ms <= 0:
        return lambda batch: None
    if device == "cuda":
        weight = torch.randn(4096, 4096, device="cuda")
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        weight @ weight
        stop.record()
        torch.cuda.synchronize()
        repeats = max(1, round(step_ms / max(start.elapsed_time(stop), 1e-3)))

        def gpu_step(batch: Any) -> None:
            for _ in range(repeats):
                weight @ weight

        return gpu_step
    return lambda batch: time.sleep(step_ms / 1000)  # CPU: simulate an accelerator


def run_bench(
    index: SlideIndex,
    *,
    tiles: int = 2000,
    batch_size: int = 64,
    workers: Sequence[int] = (0, 1, 2),
    device: str | None = None,
    step_ms: float = 50.0,
    seed: int = 0,
    busy: int = 0,
    copies: LocalCopies | None = None,
) -> dict[str, Any]:
    """All measurements, as a JSON-ready dict with ratios against the OpenSlide baseline.
    ``busy``: that many other processes spin on a core each while everything is measured
    (baseline included, so the ratios compare paths under the same load). ``copies``: where
    the OpenSlide baseline keeps local copies of slides at URLs (see `openslide_baseline`)."""
    if device is not None:
        resolve_device(device)
    if len(index) == 0:
        raise ValueError("the index has no tiles to read")
    with busy_cores(busy):
        result = _run_bench(index, tiles, batch_size, workers, device, step_ms, seed, copies)
    result["busy"] = busy
    return result


def _run_bench(
    index: SlideIndex,
    tiles: int,
    batch_size: int,
    workers: Sequence[int],
    device: str | None,
    step_ms: float,
    seed: int,
    copies: LocalCopies | None,
) -> dict[str, Any]:
    rows = sample_rows(index, tiles, seed)
    results = [
        openslide_baseline(index, rows, copies=copies),
        openslide_baseline(index, rows, reopen=True, copies=copies),
    ]
    ranges: dict[str, Any] = {}
    results.append(reader_single_process(index, rows, batch_size, ranges))
    for w in workers:
        results.append(loader_run(index, rows, w, batch_size)[0])
    out: dict[str, Any] = {
        "tiles": len(rows),
        "distinct_tiles": len(np.unique(rows)),
        "batch_size": batch_size,
        "results": [],
    }
    if ranges:
        out["remote_ranges"] = ranges
    base = results[0].tiles_per_s
    for m in results:
        out["results"].append(
            {
                **asdict(m),
                "tiles_per_s": round(m.tiles_per_s, 1),
                "cpu_us_per_tile": round(m.cpu_us_per_tile, 1),
                "vs_openslide": round(m.tiles_per_s / base, 2) if base else None,
            }
        )
    if device:
        # decode="cpu": workers decode; "device": workers ship JPEG bytes, DeviceLoader decodes
        # (nvJPEG on CUDA when torchvision is installed, libjpeg-turbo otherwise)
        for key, decode in (("device", "cpu"), ("device_decode", "device")):
            measured, waited = loader_run(
                index, rows, max(workers), batch_size, device, step_ms, decode
            )
            out[key] = {
                "device": device,
                "decode": decode,
                "workers": max(workers),
                "step_ms": step_ms,
                "tiles_per_s": round(measured.tiles_per_s, 1),
                "waiting_share": round(waited, 3),
            }
    return out


def format_table(result: dict[str, Any]) -> str:
    tiles, distinct = result["tiles"], result["distinct_tiles"]
    repeats = f" ({distinct} distinct, the index is small)" if distinct < tiles else ""
    load = f", {result['busy']} other busy processes" if result.get("busy") else ""
    lines = [
        f"{tiles} random tiles{repeats}, the same for every path, batch {result['batch_size']}"
        f"{load}",
        f"{'path':<18} {'workers':>7} {'threads':>7} {'tiles/s':>9} {'vs OpenSlide':>13} "
        f"{'CPU us/tile':>12}",
    ]
    for r in result["results"]:
        lines.append(
            f"{r['name']:<18} {r['workers']:>7} {r['threads']:>7} {r['tiles_per_s']:>9.0f} "
            f"{r['vs_openslide']:>12.2f}x {r['cpu_us_per_tile']:>12.0f}"
        )
    if "remote_ranges" in result:
        budget = result["remote_ranges"]["budget_mb"]
        for number, p in enumerate(result["remote_ranges"]["passes"], 1):
            lines.append(
                f"remote ranges, pass {number} (wsi_loader, budget {budget:.0f} MB): "
                f"{p['gets_per_tile']:.3f} GETs/tile, {p['kb_per_tile']:.1f} KB/tile, "
                f"{p['hit_rate']:.0%} of reads held already, {p['hedged']} hedged"
            )
    for key in ("device", "device_decode"):
        if key in result:
            d = result[key]
            lines.append(
                f"{d['device']}, {d['decode']} decode: {d['tiles_per_s']:.0f} tiles/s behind a "
                f"{d['step_ms']} ms step; waited for data {d['waiting_share']:.0%} of the time"
            )
    return "\n".join(lines)
