"""What a slide's content digest costs: the size-and-ends digest (first and last 64 KiB) and
the one that covers a TIFF's directory (every IFD, tile offsets and byte counts), side by side
in one run, on a synthetic 40k x 30k SVS and on every slide of ``--testdata`` (the real test
slides). Best of ``--repeats`` each, from the page cache (a first read from disk adds the
seeks: one per IFD and per out-of-line value).

    .venv/bin/python benchmarks/bench_content_digest.py [--scratch DIR] [--testdata DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import tifffile
from common import scratch_folder, synthetic_slide

from wsi_loader.index._fingerprints import content_key
from wsi_loader.index._tiff_directory import directory_bytes

OLDER = "0" * 32  # a digest of the older kind: content_key computes that kind


def best(seconds: list[float]) -> float:
    return min(seconds) * 1000


def measure(path: Path, repeats: int) -> dict[str, object]:
    size = path.stat().st_size
    older, current = [], []
    for _ in range(repeats):  # interleaved, so both see the same cache and load
        start = time.perf_counter()
        content_key(str(path), like=OLDER)
        older.append(time.perf_counter() - start)
        start = time.perf_counter()
        content_key(str(path))
        current.append(time.perf_counter() - start)
    directory = directory_bytes(str(path), size)
    try:
        with tifffile.TiffFile(path) as tif:
            tiles = sum(len(p.dataoffsets) for p in tif.pages)  # type: ignore[union-attr]
    except Exception:  # not a TIFF (a DICOM file): no tiles to count
        tiles = 0
    return {
        "slide": path.name,
        "MB": round(size / 1e6, 1),
        "tiles": tiles,
        "directory KB": None if directory is None else round(len(directory) / 1e3, 1),
        "older ms": round(best(older), 3),
        "current ms": round(best(current), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scratch", default=None, help="folder for the synthetic slide")
    parser.add_argument("--testdata", default=os.environ.get("WSI_LOADER_TEST_DATA"))
    parser.add_argument("--width", type=int, default=40_000, help="synthetic slide width")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-bench-")
    slides = [synthetic_slide(scratch / f"synthetic-{args.width}.svs", width=args.width)]
    if args.testdata:
        slides += sorted(p for p in Path(args.testdata).iterdir() if p.is_file())
    for path in slides:
        if path.suffix in (".md", ".txt"):
            continue
        print(measure(path, args.repeats), flush=True)


if __name__ == "__main__":
    main()
