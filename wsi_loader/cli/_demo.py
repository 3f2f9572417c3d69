"""``wsi-loader demo``: the main job end to end on built-in synthetic slides.

Generates a few H&E-like pyramidal slides (kept between runs), indexes them (incrementally),
streams shuffled batches through `make_loader` and `DeviceLoader`, and prints throughput next
to OpenSlide's in the same run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from wsi_loader.dataset._loader import make_loader
from wsi_loader.device._bench import openslide_baseline
from wsi_loader.device._loader import DeviceLoader
from wsi_loader.errors import ConfigError
from wsi_loader.index._builder import build_index
from wsi_loader.synthetic._slides import SlideSpec, write_svs

SLIDES = [  # name, label, spec
    ("case-001", "tumour", SlideSpec(width=16_000, height=12_000, seed=1, mpp=0.25)),
    ("case-002", "normal", SlideSpec(width=12_000, height=10_000, seed=2, mpp=0.5)),
    ("case-003", "tumour", SlideSpec(width=14_000, height=9_000, seed=3, mpp=0.25)),
]


def run(out: str | os.PathLike[str], batches: int = 40, batch_size: int = 64) -> None:
    if batches < 1 or batch_size < 1:
        raise ConfigError("--batches must be >= 1 (and batch_size >= 1)", key="batches")
    base = Path(out)
    slides = base / "slides"
    slides.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for name, _, spec in SLIDES:
        path = slides / f"{name}.svs"
        if not path.exists():
            write_svs(str(path), spec)
    (slides / "labels.csv").write_text(
        "slide,label\n" + "".join(f"{name},{label}\n" for name, label, _ in SLIDES)
    )
    print(
        f"slides: {len(SLIDES)} synthetic Aperio SVS in {slides} "
        f"({time.perf_counter() - start:.1f} s)"
    )

    start = time.perf_counter()
    index = build_index(
        [slides],
        base / "index",
        tile_size=224,
        mpp=0.5,
        min_tissue=0.5,
        labels=str(slides / "labels.csv"),
        workers=2,
        root=str(slides),
    )
    print(
        f"index: {len(index)} tiles of 224 px at 0.5 um/px in {base / 'index'} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    for s in index.slides:
        print(
            f"  {s.path:<14} {s.label or '-':<7} {s.tiles:>6} tiles  level {s.read_level} "
            f"window {s.read_size} px  ({s.mpp} um/px scanned)"
        )

    loader = make_loader(index, batch_size=batch_size, drop_last=True)  # readers chosen for us
    assert loader.readers is not None
    readers = (
        f"{loader.readers.threads} reader threads"
        if loader.readers.kind == "threads"
        else f"{loader.readers.workers} workers"
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stream = DeviceLoader(loader, device)
    seen, epoch = 0, 0
    first_batch_done: float | None = None
    while seen < batches * batch_size:
        loader.set_epoch(epoch)  # a new shuffle every epoch
        for batch in stream:
            if first_batch_done is None:  # the first batch pays for start-up
                first_batch_done = time.perf_counter()
                continue
            seen += len(batch["image"])
            if seen >= batches * batch_size:
                break
        epoch += 1
    assert first_batch_done is not None
    rate = seen / (time.perf_counter() - first_batch_done)
    sample = np.random.default_rng(0).permutation(len(index))[:300]
    baseline = openslide_baseline(index, sample)
    print(
        f"stream: {seen} tiles in batches of {batch_size} ({readers}, {device}): "
        f"{rate:.0f} tiles/s; OpenSlide read_region in one process: "
        f"{baseline.tiles_per_s:.0f} tiles/s ({rate / baseline.tiles_per_s:.1f}x)"
    )
    print(
        f"last batch: image {tuple(batch['image'].shape)} {batch['image'].dtype} on {device}, "
        f"ok {int(batch['ok'].sum())}/{len(batch['ok'])}, labels {index.label_names}"
    )
