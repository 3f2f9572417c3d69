"""Index build time: per slide for 10k/20k/40k px wide synthetic slides, 100 small slides
with 1 vs 2 workers, and what region annotations and quality control add. Build time must
follow the lowest level's size, not level 0's; annotation labelling must add < 50% to a build;
quality control at most 150 ms of CPU on the 40k x 30k slide, and nothing with qc none.

    .venv/bin/python benchmarks/bench_index.py [--scratch DIR] [--only annotations|qc]

The QC section builds the 40k x 30k slide with qc none and qc all, 7 interleaved builds each,
and prints the best wall and CPU seconds of each and the difference in CPU milliseconds.

The annotation section indexes the 40k x 30k slide with and without 50 QuPath polygons of
1,000 vertices each (5 classes, overlapping, some reaching past tile borders everywhere),
with tile labels from the annotations, best of 5 interleaved builds each, in the same run,
in wall and CPU seconds; then with 20,000 small cell-detection outlines (3 classes) instead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
from common import scratch_folder, synthetic_slide

from wsi_loader.index import build_index
from wsi_loader.slides import open_slide


def timed_build(inputs: list[Path], out: Path, **options: object) -> float:
    return cpu_build(inputs, out, **options)[0]


def cpu_build(inputs: list[Path], out: Path, **options: object) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all its threads) of one build."""
    shutil.rmtree(out, ignore_errors=True)
    start, cpu = time.perf_counter(), time.process_time()
    build_index(inputs, out, **options)  # type: ignore[arg-type]
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scratch", default=None, help="folder for the synthetic slides")
    parser.add_argument("--small", type=int, default=100, help="number of small slides")
    parser.add_argument("--only", choices=["annotations", "qc"], help="run only this section")
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-bench-")
    if args.only == "annotations":
        annotations_section(scratch)
        return
    if args.only == "qc":
        qc_section(scratch)
        return

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
    annotations_section(scratch)
    qc_section(scratch)


def qc_section(scratch: Path) -> None:
    """What quality control adds to a build of the 40k x 30k slide (CPU of every thread)."""
    width = 40_000
    slide = synthetic_slide(scratch / f"w{width}.svs", width=width, seed=width)
    print(f"\n## Quality control: {slide.name} (min_tissue 0.5, 256 px at 0.5 um/px)")
    options = {"mpp": 0.5, "min_tissue": 0.5}
    cpu_build([slide], scratch / "idx-q", **options, qc="all")  # warm
    runs: dict[str, list[tuple[float, float]]] = {"none": [], "all": []}
    for _ in range(7):  # interleaved, so a slow spell of the machine hits both alike
        for mode, timings in runs.items():
            timings.append(cpu_build([slide], scratch / f"idx-q-{mode}", **options, qc=mode))
    print(f"{'build':<12} {'seconds':>8} {'CPU ms':>8}")
    best = {mode: (min(w for w, _ in r), min(c for _, c in r)) for mode, r in runs.items()}
    for mode, (wall, cpu) in best.items():
        print(f"{'qc ' + mode:<12} {wall:>8.3f} {cpu * 1e3:>8.1f}")
    added = (best["all"][1] - best["none"][1]) * 1e3
    index = build_index([slide], scratch / "idx-q-all", **options)  # type: ignore[arg-type]
    print(
        f"quality control adds {added:.0f} ms of CPU ({len(index)} tiles; limit 150 ms); "
        f"picture {index.slides[0].qc['picture'] if index.slides[0].qc else '-'}"
    )


def write_polygons(path: Path, width: int, height: int, count: int, vertices: int) -> None:
    """``count`` wobbly closed polygons of ``vertices`` points, 5 classes, as QuPath GeoJSON."""
    rng = np.random.default_rng(7)
    features = []
    for i in range(count):
        cx, cy = rng.uniform(0.1, 0.9) * width, rng.uniform(0.1, 0.9) * height
        radius = rng.uniform(800, 4000)
        angle = np.linspace(0, 2 * np.pi, vertices, endpoint=False)
        wobble = (
            1 + 0.25 * np.sin(angle * rng.integers(3, 9)) + 0.03 * rng.standard_normal(vertices)
        )
        ring = np.column_stack(
            [cx + radius * wobble * np.cos(angle), cy + radius * wobble * np.sin(angle)]
        )
        features.append(
            {
                "type": "Feature",
                "geometry": {
                    "type": "Polygon",
                    "coordinates": [[*ring.tolist(), ring[0].tolist()]],
                },
                "properties": {"classification": {"name": f"class{i % 5}"}},
            }
        )
    path.write_text(json.dumps({"type": "FeatureCollection", "features": features}))


def write_nuclei(path: Path, width: int, height: int, count: int) -> None:
    """``count`` small 16-vertex outlines on a jittered grid in 3 classes, as QuPath exports
    cell detections (here: all in the top-left part of the slide)."""
    rng = np.random.default_rng(8)
    side = int(np.ceil(np.sqrt(count)))
    angle = np.linspace(0, 2 * np.pi, 16, endpoint=False)
    features = []
    for i in range(count):
        cx = (i % side) * 40 + 20 + rng.uniform(-5, 5)
        cy = (i // side) * 40 + 20 + rng.uniform(-5, 5)
        radius = rng.uniform(6, 12)
        ring = np.column_stack([cx + radius * np.cos(angle), cy + radius * np.sin(angle)])
        features.append(
            {
                "type": "Feature",
                "geometry": {
                    "type": "Polygon",
                    "coordinates": [[*ring.tolist(), ring[0].tolist()]],
                },
                "properties": {
                    "objectType": "detection",
                    "classification": {"name": ["Tumor", "Lymphocyte", "Stroma"][i % 3]},
                },
            }
        )
    path.write_text(json.dumps({"type": "FeatureCollection", "features": features}))


def annotations_section(scratch: Path) -> None:
    width = 40_000
    slide = synthetic_slide(scratch / f"w{width}.svs", width=width, seed=width)
    notes = scratch / "annotations"
    notes.mkdir(exist_ok=True)
    write_polygons(notes / f"w{width}.geojson", width, width * 3 // 4, 50, 1000)
    print(f"\n## Annotations: {slide.name} with 50 polygons of 1,000 vertices (5 classes)")
    options = {"mpp": 0.5, "min_tissue": 0.5}
    labelled = {"annotations": str(notes), "label_from": "annotations", **options}
    cpu_build([slide], scratch / "idx-a", **options)  # warm
    plain, annotated = [], []
    for _ in range(5):  # interleaved, so a slow spell of the machine hits both alike
        plain.append(cpu_build([slide], scratch / "idx-a", **options))
        annotated.append(cpu_build([slide], scratch / "idx-b", **labelled))
    index = build_index([slide], scratch / "idx-b", **labelled)  # type: ignore[arg-type]
    labelled_tiles = int((index.tile_labels() >= 0).sum())
    # best of 5 each; CPU counts every thread (labels are measured beside the tissue mask)
    wall_0, cpu_0 = min(w for w, _ in plain), min(c for _, c in plain)
    wall_1, cpu_1 = min(w for w, _ in annotated), min(c for _, c in annotated)
    print(f"{'build':<26} {'seconds':>8} {'CPU s':>8}")
    print(f"{'without annotations':<26} {wall_0:>8.3f} {cpu_0:>8.3f}")
    added = f"+{wall_1 / wall_0 - 1:.0%} wall, +{cpu_1 / cpu_0 - 1:.0%} CPU"
    print(
        f"{'with annotations, labels':<26} {wall_1:>8.3f} {cpu_1:>8.3f}   ({added}; "
        f"{len(index)} tiles, {labelled_tiles} labelled, classes {list(index.classes)})"
    )
    # cell detections: many small outlines, many per tile
    cells = scratch / "detections"
    cells.mkdir(exist_ok=True)
    write_nuclei(cells / f"w{width}.geojson", width, width * 3 // 4, 20_000)
    detected = {**labelled, "annotations": str(cells)}
    runs = [cpu_build([slide], scratch / "idx-c", **detected) for _ in range(3)]
    wall_2, cpu_2 = min(w for w, _ in runs), min(c for _, c in runs)
    added = f"+{wall_2 / wall_0 - 1:.0%} wall, +{cpu_2 / cpu_0 - 1:.0%} CPU"
    print(f"{'20,000 cell outlines':<26} {wall_2:>8.3f} {cpu_2:>8.3f}   ({added})")


if __name__ == "__main__":
    main()
