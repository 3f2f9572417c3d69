"""Multi-scale context tiles: their cost, every ratio measured in this one run.

    .venv/bin/python benchmarks/bench_context.py [--tiles 3000] [--scratch DIR] [--busy N]

The issue's case: 224 px tiles at 0.5 um/px, plus one context scale of 224 px at 2.0 um/px,
from 40x synthetic Aperio slides (20k x 15k at 0.25 um/px, levels of downsample 1/4/16):
tiles are 448 px windows of level 0 and context tiles 448 px windows of level 1 (1.0 um/px),
both shrunk by libjpeg's DCT scaling. Three loaders, make_loader with 2 workers (fork) and
batch 64, each reading the same rows in the same order:

- ``tiles``: make_loader without context (the single-scale rate);
- ``context``: make_loader(..., context=[(2.0, 224)]): the context windows are read in the
  same batch read as the tiles;
- ``glue``: what training scripts do today: the same tiles, plus a second OpenSlide
  ``read_region`` per item at the lower level (448 px of level 1, resized to 224 by PIL) in
  the worker (a ``batch_transform`` with one OpenSlide handle per worker).

in three orders: ``random`` (the default shuffle over every slide: neighbouring rows of a
batch are far apart, they share no level-0 storage tile), ``slide-window`` (the training
shuffle that keeps locality: `DistributedTileSampler(slide_window=1)`, slides shuffled, then
tiles shuffled within each slide) and ``grid`` (rows in grid order, as export, features and
predict read): neighbouring tiles' windows overlap, and their shared storage tiles are
decoded once. Four slides (~2,000 tiles
with tissue) so that the passes read more than the caches hold: the level-0 storage tiles
under the tiles are decoded again and again, while the level-1 ones under the context
windows (a sixteenth of the slide's pixels: 14 MB per slide decoded at half size, less where
there is no tissue) stay in the segment cache, whose segmented LRU keeps what is used again.

The cost of context is tiles/s without it over tiles/s with it. The decode counts (the same
rows, dealt in batches to two readers as to make_loader's workers) say why: storage tiles
decoded per row for the tiles and for the context windows, and for the context windows with
the segment cache a plain LRU.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import openslide
import torch
from bench_fast import interleaved, line, loader_pass
from common import scratch_folder, synthetic_slide
from PIL import Image

from wsi_loader.dataset import DistributedTileSampler, TileBatch, TileDataset, make_loader
from wsi_loader.dataset._reading import TileReader
from wsi_loader.device._bench import busy_cores
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.slides import _pool as pool_module
from wsi_loader.slides import _tiff
from wsi_loader.slides._base import BytesLRU

SCALE = (2.0, 224)


class OpenSlideContext:
    """The usual glue: a second OpenSlide read_region per item, at the level that has the
    context resolution, resized with PIL (one handle per worker process, opened lazily)."""

    def __init__(self, index: SlideIndex) -> None:
        self.paths = [index.slide_path(i) for i in range(len(index.slides))]
        self.slides: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "slides": {}}

    def __call__(self, batch: TileBatch) -> TileBatch:
        size = SCALE[1]
        out = torch.empty((len(batch), size, size, 3), dtype=torch.uint8)
        for i, (slide_id, x, y) in enumerate(
            zip(batch.slide_id.tolist(), batch.x.tolist(), batch.y.tolist(), strict=True)
        ):
            slide = self.slides.get(slide_id)
            if slide is None:
                slide = self.slides[slide_id] = openslide.OpenSlide(self.paths[slide_id])
            # the tile covers 448 level-0 px (112 um); its context 448 um = 1792 level-0 px
            # = 448 px of level 1, around the same centre
            cx, cy = x + 224, y + 224
            region = slide.read_region((cx - 896, cy - 896), 1, (448, 448))
            image = region.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
            out[i] = torch.from_numpy(np.array(image))
        batch.context = [out]
        return batch


class PlainLRU(BytesLRU[Any]):
    """The segment cache as a plain LRU (what it was before it became a segmented LRU), to
    count what that policy decodes on the same rows."""

    def __init__(self, max_bytes: int = 32 * 2**20) -> None:
        super().__init__(max_bytes, size=lambda pixels: pixels.nbytes)

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def put(self, key: Any, value: Any, planned: bool = False) -> None:
        super().put(key, value)


def decodes_per_row(
    index: SlideIndex, rows: list[int], batch: int, plain_lru: bool = False
) -> tuple[float, float]:
    """Storage tiles decoded per row, for the tiles (level 0) and for their context windows
    (level 1), reading ``rows`` in batches of ``batch`` as make_loader's 2 workers do (batches
    dealt in turn to two readers, each with its own segment cache), on one thread.
    ``plain_lru``: with the segment cache a plain LRU instead of a segmented one."""
    counted = {0: 0, 1: 0}
    original = _tiff.TiffReader._decoder

    def counting(self: Any, level: int, index: int, scale: int) -> Any:
        counted[level] = counted.get(level, 0) + 1  # the serial path decodes what it asks for
        return original(self, level, index, scale)

    _tiff.TiffReader._decoder = counting  # type: ignore[method-assign]
    cache = pool_module.SegmentCache
    if plain_lru:
        pool_module.SegmentCache = PlainLRU  # type: ignore[misc,assignment]
    try:
        readers = [TileReader(index, context=[SCALE], record_failures=False) for _ in range(2)]
        for n, start in enumerate(range(0, len(rows), batch)):
            readers[n % 2].read(rows[start : start + batch])
    finally:
        _tiff.TiffReader._decoder = original  # type: ignore[method-assign]
        pool_module.SegmentCache = cache  # type: ignore[misc]
    return counted[0] / len(rows), counted[1] / len(rows)


def slide_window_order(index: SlideIndex, epochs: int) -> list[int]:
    """Rows as `DistributedTileSampler(slide_window=1)` deals them over ``epochs`` epochs."""
    sampler = DistributedTileSampler(
        TileDataset(index, record_failures=False), num_replicas=1, rank=0, slide_window=1
    )
    rows: list[int] = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        rows.extend(int(r) for r in sampler)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", type=int, default=3000, help="tiles per loader epoch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch", help="folder for the slide (kept between runs)")
    parser.add_argument("--busy", type=int, default=0, help="other processes spinning")
    args = parser.parse_args()
    with busy_cores(args.busy):
        run(args)


def run(args: argparse.Namespace) -> None:
    scratch = scratch_folder(args.scratch, "wsi-bench-context-")
    # more distinct tiles than the passes read and the caches hold: reads, not cache hits
    slides = [
        synthetic_slide(
            scratch / ("fine.svs" if seed == 6 else f"fine{seed}.svs"), seed=seed, mpp=0.25
        )
        for seed in (6, 7, 8, 9)
    ]
    index = build_index(slides, scratch / "context4", tile_size=224, mpp=0.5, min_tissue=0.5)
    repeats = -(-args.tiles // len(index))
    orders = {
        "random": np.concatenate(
            [np.random.default_rng(k).permutation(len(index)) for k in range(repeats)]
        )[: args.tiles].tolist(),
        "slide-window": slide_window_order(index, repeats)[: args.tiles],
        "grid": np.tile(np.arange(len(index)), repeats)[: args.tiles].tolist(),
    }
    if args.busy:
        print(f"# with {args.busy} other processes spinning on a core each")
    print(
        f"# {len(slides)} slides of 20k x 15k at 0.25 um/px, {len(index)} tiles of 224 px at "
        "0.5 um/px; "
        f"context {SCALE[1]} px at {SCALE[0]} um/px; make_loader, 2 workers (fork), batch 64, "
        f"{args.tiles} tiles per pass, best of {args.repeats}"
    )
    for name, order in orders.items():
        opts: dict[str, Any] = {
            "sampler": order,
            "num_workers": 2,
            "multiprocessing_context": "fork",
            "record_failures": False,
        }
        r = interleaved(
            {
                "tiles": loader_pass(make_loader(index, 64, **opts), len(order)),
                "context": loader_pass(make_loader(index, 64, context=[SCALE], **opts), len(order)),
                "glue": loader_pass(
                    make_loader(index, 64, batch_transform=OpenSlideContext(index), **opts),
                    len(order),
                ),
            },
            args.repeats,
        )
        tiles, context, glue = (r[k].tiles_per_s for k in ("tiles", "context", "glue"))
        main_decodes, context_decodes = decodes_per_row(index, order, 64)
        _, context_plain = decodes_per_row(index, order, 64, plain_lru=True)
        print(f"\n## {name} order")
        print(line("tiles only", r["tiles"]))
        print(
            line("tiles + context (make_loader)", r["context"], f" = cost {tiles / context:.2f}x")
        )
        print(
            line(
                "tiles + OpenSlide read_region glue",
                r["glue"],
                f" = cost {tiles / glue:.2f}x; context path {context / glue:.2f}x the glue",
            )
        )
        print(
            f"storage tiles decoded per row (DCT 1/2, 2 readers): tiles {main_decodes:.2f}, "
            f"context {context_decodes:.2f} (with a plain LRU segment cache: {context_plain:.2f})"
        )


if __name__ == "__main__":
    main()
