"""Set-up shared by the benchmark scripts (imported as ``common``: they run as scripts)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from wsi_loader.index import SlideIndex, build_index
from wsi_loader.synthetic import SlideSpec, write_svs


def scratch_folder(path: str | None, prefix: str) -> Path:
    """``--scratch`` (kept between runs, so slides are written once) or a new temporary folder."""
    folder = Path(path or tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def synthetic_slide(path: Path, width: int = 20_000, seed: int = 0, mpp: float = 0.5) -> Path:
    """A synthetic 4:3 Aperio SVS at ``path``, written only when it is not there yet."""
    if not path.exists():
        written(path, SlideSpec(width=width, height=width * 3 // 4, seed=seed, mpp=mpp))
    return path


def written(path: Path, spec: SlideSpec) -> None:
    """Write a synthetic SVS to ``path`` whole or not at all: into a temporary name beside it,
    renamed when complete (a run stopped mid-write must not leave a broken slide that the
    next run, finding the file, would use)."""
    partial = path.with_name(f".{path.name}.partial")
    write_svs(str(partial), spec)
    os.replace(partial, path)


def random_rows_of_one_slide(folder: Path, tiles: int) -> tuple[SlideIndex, list[int]]:
    """An index of 256 px tiles at 0.5 um/px over one synthetic 20k px SVS in ``folder``
    (written once), and ``tiles`` of its rows drawn at random (seed 0; repeats allowed)."""
    slide = synthetic_slide(folder / "slide.svs", width=20_000)
    index_dir = folder / "index"
    if not index_dir.exists():
        build_index([str(slide)], index_dir, tile_size=256, mpp=0.5)
    index = SlideIndex.open(index_dir)
    rows = np.random.default_rng(0).integers(0, len(index), tiles).tolist()
    return index, rows
