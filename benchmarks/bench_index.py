"""Index build time: per slide for 10k/20k/40k px wide synthetic slides, and 100 small slides
with 1 vs 2 workers. Build time must follow the lowest level's size, not level 0's.

    .venv/bin/python benchmarks/bench_index.py [--scratch DIR]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from common import scratch_folder, synthetic_slide

from wsi_loader.index import build_index
from wsi_loader.slides import open_slide


def timed_build(inputs: list[Path], out: Path, **options: object) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    build_index(inputs, out, **options)  # type: ignore[arg-type]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scratch", default=None, help="folder for the synthetic slides")
    parser.add_argument("--small", type=int, default=100, help="number of small slides")
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-bench-")

    print("## Build time per slide (min_tissue 0.5, 256 px at 0.5 um/px, 1 worker, best of 3)")
    print(
        f"{'level 0':>14} {'lowest level':>14} {'tiles':>7} {'build ms':>9} {'us per low px':>14}"
    )
    base = None
    warm = synthetic_slide(scratch / "warm.svs", width=2000)
    timed_build([warm], scratch / "idx")  # imports and first-open costs out of the way
    for width in (10_000, 20_000, 40_000):
        height = width * 3 // 4
        path = synthetic_slide(scratch / f"w{width}.svs", width=width, seed=width)
        best = min(timed_build([path], scratch / "idx", mpp=0.5) for _ in range(3))
        index = build_index([path], scratch / "idx", mpp=0.5)
        record = index.slides[0]
        low_w, low_h = open_slide(index.slide_path(0)).meta.level_dimensions[record.mask_level or 0]
        per_px = best * 1e6 / (low_w * low_h)
        base = base or best
        print(
            f"{width:>7}x{height:<6} {low_w:>7}x{low_h:<6} {len(index):>7} {best * 1e3:>9.1f} "
            f"{per_px:>14.2f}   ({best / base:.2f}x the 10k slide; level 0 is "
            f"{width * height / 75e6:.0f}x)"
        )

    print(f"\n## {args.small} small slides (2000x1500), 1 vs 2 workers")
    folder = scratch / "small"
    folder.mkdir(exist_ok=True)
    for i in range(args.small):
        synthetic_slide(folder / f"s{i:03d}.svs", width=2000, seed=1000 + i)
    serial = timed_build([folder], scratch / "idx-small", workers=1)
    parallel = timed_build([folder], scratch / "idx-small", workers=2)
    print(f"{'workers':>8} {'seconds':>8} {'slides/s':>9} {'speed-up':>9}")
    print(f"{1:>8} {serial:>8.2f} {args.small / serial:>9.1f} {1.0:>9.2f}")
    print(f"{2:>8} {parallel:>8.2f} {args.small / parallel:>9.1f} {serial / parallel:>9.2f}")
    start = time.perf_counter()
    build_index([folder], scratch / "idx-small", workers=2)
    print(f"incremental re-run (nothing changed): {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
