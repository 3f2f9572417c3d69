"""Feature extraction throughput: `wsi_loader.features.extract` against a CLAM-style extractor,
and `wsi_loader.predict` (the same pass, another writer) against the same peer.

    .venv/bin/python benchmarks/bench_features.py [--slides 4] [--width 16384] [--workers 2]
        [--tile-size 224] [--threads N] [--model cheap|cnn] [--clam DIR --clam-python PY]

The default slides (4 x 16,384 px, 5,908 tiles: ~2 s a pass here) make throughput what is
measured; at 8192 px (1,538 tiles, ~0.5 s) starting the workers and the first batch, ~80 ms,
are a sixth of a pass.

The default grid is 224 px over the slides' 256 px storage tiles: most windows cover parts of
four storage tiles, which whole-slide passes decode once each (`wsi_loader.dataset._scan`).

The peer does what CLAM's ``extract_features_fp.py`` does: per slide, the tile coordinates from
an h5 file, a Dataset that opens the slide with OpenSlide and reads one tile per item
(``read_region`` + RGB conversion, then to-tensor and normalise on the CPU, as its
transforms do), the default collate, a new DataLoader per slide, the model, an h5 per slide.
Both run the same cheap model (global average pool + linear, so the data path is what is
measured), the same tiles, batch size and workers, in this one run, best of --repeats.
``--model cnn`` runs a small three-layer CNN instead (a model that keeps the CPU busy, for
what ``--threads`` does to a pass whose model is not cheap).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import openslide
import torch
from common import scratch_folder, synthetic_slide
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_models import make_model

from wsi_loader.export import export_index
from wsi_loader.features import encoder_from, extract
from wsi_loader.index import build_index
from wsi_loader.predict._run import predict

MEAN = torch.tensor((0.485, 0.456, 0.406)).view(3, 1, 1)
STD = torch.tensor((0.229, 0.224, 0.225)).view(3, 1, 1)


class WholeSlideBag(Dataset[dict[str, Any]]):
    """CLAM's Whole_Slide_Bag_FP: coords from an h5, OpenSlide opened per slide, one tile per
    item, to-tensor and normalise in the worker."""

    def __init__(self, coords_h5: Path, slide: str) -> None:
        with h5py.File(coords_h5, "r") as h5:
            self.coords = h5["coords"][:]
            self.patch_level = int(h5["coords"].attrs["patch_level"])
            self.patch_size = int(h5["coords"].attrs["patch_size"])
        self.wsi = openslide.OpenSlide(slide)

    def __len__(self) -> int:
        return len(self.coords)

    def __getitem__(self, i: int) -> dict[str, Any]:
        x, y = self.coords[i]
        size = (self.patch_size, self.patch_size)
        image = self.wsi.read_region((int(x), int(y)), self.patch_level, size).convert("RGB")
        tensor = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255
        return {"img": (tensor - MEAN) / STD, "coord": self.coords[i]}


def clam_style(
    coords_dir: Path, slides: dict[str, str], out: Path, batch: int, workers: int, kind: str
) -> int:
    model = make_model(kind)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    tiles = 0
    for name, slide in slides.items():
        dataset = WholeSlideBag(coords_dir / f"{name}.h5", slide)
        loader = DataLoader(dataset, batch_size=batch, num_workers=workers)
        features, coords = [], []
        with torch.inference_mode():
            for item in loader:
                features.append(model(item["img"]).numpy())
                coords.append(item["coord"].numpy())
        with h5py.File(out / f"{name}.h5", "w") as h5:
            h5["features"] = np.concatenate(features)
            h5["coords"] = np.concatenate(coords)
        tiles += len(dataset)
    return tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slides", type=int, default=4)
    parser.add_argument("--width", type=int, default=16384, help="level-0 width of each slide")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tile-size", type=int, default=224, help="over 256 px storage tiles")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads of the main process, for both (default: torch's)",
    )
    parser.add_argument("--model", choices=["cheap", "cnn"], default="cheap")
    parser.add_argument(
        "--clam",
        metavar="DIR",
        help="a checkout of mahmoodlab/CLAM: also run CLAM's own data path (clam_real.py)",
    )
    parser.add_argument(
        "--clam-python",
        metavar="PY",
        help="the Python that runs it (torchvision, h5py, openslide, pandas installed)",
    )
    parser.add_argument("--scratch")
    args = parser.parse_args()
    if bool(args.clam) != bool(args.clam_python):
        parser.error("--clam and --clam-python go together")
    if args.threads:
        torch.set_num_threads(args.threads)
    scratch = scratch_folder(args.scratch, "wsi-bench-features-")
    folder = scratch / "slides"
    folder.mkdir(exist_ok=True)
    for i in range(args.slides):
        synthetic_slide(folder / f"s{i}.svs", width=args.width, seed=300 + i)
    index = build_index(
        [folder], scratch / f"index-{args.tile_size}", tile_size=args.tile_size, mpp=0.5,
        min_tissue=0.25,
    )  # fmt: skip
    coords = scratch / f"coords-{args.tile_size}"
    export_index(index, coords, format="coords-h5")
    slides = {Path(s.path).stem: index.slide_path(i) for i, s in enumerate(index.slides)}
    encoder = encoder_from(
        (make_model(args.model), {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)})
    )
    print(
        f"{len(index)} tiles of {args.slides} slides ({args.width} px wide), {args.tile_size} px "
        "at 0.5 um/px over 256 px storage tiles, "
        f"batch {args.batch_size}, {args.workers} workers, {args.model} model, CPU, "
        f"{torch.get_num_threads()} intra-op threads"
    )
    job = scratch / "clam-job.json"
    job.write_text(
        json.dumps(
            {
                "slides": slides, "coords": str(coords), "out": str(scratch / "clam-real"),
                "batch": args.batch_size, "workers": args.workers, "model": args.model,
                "threads": args.threads, "patch_size": args.tile_size,
            }
        )
    )  # fmt: skip
    keys = ["peer", "extract", "predict", *(["clam"] if args.clam else [])]
    best = dict.fromkeys(keys, 0.0)  # tiles/s
    cpu = dict.fromkeys(keys, math.inf)  # ms per tile
    for _ in range(args.repeats):  # interleaved: a slow spell hits all alike
        shutil.rmtree(scratch / "ours", ignore_errors=True)
        shutil.rmtree(scratch / "predict", ignore_errors=True)
        start, used = time.perf_counter(), cpu_seconds()
        report = extract(
            index,
            encoder,
            scratch / "ours",
            batch_size=args.batch_size,
            workers=args.workers,
            device="cpu",
        )
        note("extract", report.tiles, start, used, best, cpu)
        start, used = time.perf_counter(), cpu_seconds()
        tiles = clam_style(
            coords, slides, scratch / "clam", args.batch_size, args.workers, args.model
        )
        note("peer", tiles, start, used, best, cpu)
        start, used = time.perf_counter(), cpu_seconds()
        predicted = predict(
            index, encoder, scratch / "predict", batch_size=args.batch_size,
            workers=args.workers, device="cpu", heatmaps=False,
        )  # fmt: skip
        note("predict", predicted.tiles, start, used, best, cpu)
        if args.clam:
            run = subprocess.run(
                [args.clam_python, str(Path(__file__).with_name("clam_real.py")),
                 "--clam", args.clam, "--job", str(job)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            result = json.loads(run.stdout.strip().splitlines()[-1])
            best["clam"] = max(best["clam"], result["tiles"] / result["wall"])
            cpu["clam"] = min(cpu["clam"], result["cpu"] / result["tiles"] * 1000)
    names = {
        "peer": "CLAM-style extractor",
        "clam": "CLAM's own code",
        "extract": "wsi_loader extract",
        "predict": "wsi_loader predict",
    }
    for base in ["peer", *(["clam"] if args.clam else [])]:
        print(f"\nagainst {'the ' if base == 'peer' else ''}{names[base]}:")
        print(f"{'':<24} {'tiles/s':>8} {'ratio':>6}  {'CPU ms/tile':>11} {'ratio':>6}")
        for key in [base, "extract", "predict"]:
            print(
                f"{names[key]:<24} {best[key]:8.0f} {best[key] / best[base]:5.2f}x  "
                f"{cpu[key]:11.3f} {cpu[base] / cpu[key]:5.2f}x"
            )
    if args.clam:
        print(
            "(CLAM's own code: its Whole_Slide_Bag_FP, transforms and save_hdf5 from --clam, in "
            "--clam-python's torch, start-up left out; it opens the coordinates h5 per tile)"
        )
    print(
        "(predict writes CSV, GeoJSON and slides.csv, no heatmaps; CPU: all processes of the "
        "run, workers included: the work done, which other jobs on the machine do not change)"
    )


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def note(
    key: str, tiles: int, start: float, used: float, best: dict[str, float], cpu: dict[str, float]
) -> None:
    best[key] = max(best[key], tiles / (time.perf_counter() - start))
    cpu[key] = min(cpu[key], (cpu_seconds() - used) / tiles * 1000)


if __name__ == "__main__":
    main()
