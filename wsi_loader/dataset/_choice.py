"""How `make_loader` reads when ``num_workers="auto"`` (its default): decode threads in this
process (`wsi_loader.dataset._threaded`), or DataLoader worker processes, and how many.

Why threads on a few cores: the decoders (libjpeg-turbo through simplejpeg, imagecodecs,
OpenSlide through ctypes) run without the GIL, so threads decode on every core, and a process
of its own per core costs what threads do not: worker start-up before the first batch, a pickle
per batch to hand it over (a slot number of a shared ring, `_transport`), a second copy of the
slide handles and caches. Processes keep the upper hand where the Python around the decode is
a large share of a tile's time (a Python ``transform`` per tile, stain transforms, slides
OpenSlide reads, whose pixels are converted under the GIL), where one process's GIL would
serialise it, and on many cores (unmeasured here: processes, as before). Figures in
benchmarks/README.md ("Threads or processes").
"""

from __future__ import annotations

from typing import NamedTuple

from wsi_loader.dataset._cores import usable_cores
from wsi_loader.dataset._tiles import TileDataset

# the most usable cores one process's decode threads are chosen for (measured on 2 cores)
MAX_THREADED_CORES = 4
MAX_WORKERS = 8


class ReaderChoice(NamedTuple):
    """What reads the batches: ``"threads"`` (``threads`` reader threads in this process, each
    with a decode thread of its own), ``"processes"`` (``workers`` DataLoader workers) or
    ``"main"`` (this thread, as the consumer asks for them: ``num_workers=0``), and why."""

    kind: str
    workers: int
    threads: int
    reason: str


def choose_readers(
    tiles: TileDataset,
    num_workers: int | str | None,
    *,
    timeout: float = 0,
    multiprocessing_context: str | None = None,
    cores: int | None = None,
) -> ReaderChoice:
    """The readers for ``tiles``: an explicit ``num_workers`` as given (0: this thread), else
    chosen from the usable ``cores`` (default: this process's affinity mask) and what the
    reads need (see the module's docstring)."""
    cores = usable_cores() if cores is None else cores
    if isinstance(num_workers, int):
        if num_workers == 0:
            return ReaderChoice("main", 0, 0, "num_workers=0: batches read as they are asked for")
        return ReaderChoice("processes", num_workers, 0, f"num_workers={num_workers}")
    workers = max(1, min(cores, MAX_WORKERS))
    needs_processes = _needs_processes(tiles, timeout, multiprocessing_context)
    if needs_processes:
        return ReaderChoice("processes", workers, 0, needs_processes)
    if cores > MAX_THREADED_CORES:
        return ReaderChoice(
            "processes",
            workers,
            0,
            f"{cores} usable cores: one process's GIL would limit the Python part of the reads",
        )
    return ReaderChoice(
        "threads",
        0,
        cores,
        f"{cores} usable core{'s' if cores != 1 else ''} and decodes that release the GIL: a "
        "reader thread per core, no worker start-up, no batch handed between processes",
    )


def _needs_processes(
    tiles: TileDataset, timeout: float, multiprocessing_context: str | None
) -> str | None:
    """Why the reads need worker processes, or None when threads serve."""
    if timeout:
        return f"timeout={timeout}: a read that hangs can be given up only in a worker process"
    if multiprocessing_context is not None:
        return f"multiprocessing_context={multiprocessing_context!r} asks for worker processes"
    python = [name for name in ("transform", "batch_transform") if getattr(tiles, name) is not None]
    if tiles.stain is not None:
        python.append("stain")
    if python:
        verb = "runs" if len(python) == 1 else "run"
        return f"{' and '.join(python)} {verb} in Python, under the GIL"
    backend = tiles.reader.backend
    openslide = backend == "openslide" or (
        backend == "auto" and any(s.backend == "openslide" for s in tiles.index.slides)
    )
    if openslide:
        return "slides read by OpenSlide, whose pixels are converted under the GIL"
    return None
