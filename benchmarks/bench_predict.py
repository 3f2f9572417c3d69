"""Whole-slide inference: `wsi_loader.predict` against WSInfer's ``wsinfer run``.

    .venv/bin/python benchmarks/bench_predict.py --wsinfer /tmp/wsinfer-venv/bin/wsinfer
        [--slides 4] [--width 8192] [--workers 2] [--batch-size 64] [--model cheap|cnn]

WSInfer pins its own torch, torchvision and zarr 2, so it lives in its own virtual environment
(``--wsinfer`` names its command)::

    python3 -m venv /tmp/wsinfer-venv
    /tmp/wsinfer-venv/bin/pip install torch torchvision wsinfer "zarr<3" "tiffslide<3"

Both run the same TorchScript model with the same WSInfer config (patch size, spacing,
normalisation), on the same synthetic slides, CPU, same workers and batch size. WSInfer loads
its model zoo registry from the network when its CLI starts: it is given an empty registry
(in a scratch HOME) and ``HF_HUB_OFFLINE=1``; the model is local (``--model-path``,
``--config``), nothing is downloaded.

Timed: the whole command (tissue detection and patching, then inference), and inference alone
(WSInfer's ``run`` minus its ``patch`` of the same slides; our ``predict`` on a built index).
The grids: both start at (0, 0) and step one patch at the same MPP, so tiles that both keep
sit at the same level-0 positions; which tiles each keeps differs (WSInfer's Otsu-style
segmentation of a thumbnail and tile centres inside its polygons; our tissue fraction of each
tile >= --min-tissue), so agreement is measured on the positions both have. ``cheap`` (global
pool + linear) measures the data path; ``cnn`` a small convolutional net, where the model's
share grows on a CPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from common import scratch_folder, synthetic_slide
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wsi_loader.index import build_index
from wsi_loader.predict._run import predict

PATCH, MPP = 256, 0.5
MEAN, STD = [0.7, 0.55, 0.7], [0.15, 0.2, 0.15]


class Cheap(nn.Module):
    """Global average pool + linear, 2 classes: the data path is what is measured."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.mean(dim=(2, 3)))


class SmallCnn(nn.Module):
    """Three strided convolutions, pool, linear: a model with a cost of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=4), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 2),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def write_model(folder: Path, kind: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model = (Cheap() if kind == "cheap" else SmallCnn()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript, since torch 2.13
        traced = torch.jit.trace(model, torch.rand(2, 3, PATCH, PATCH))
        torch.jit.save(traced, str(folder / "model.pt"))
    config = {
        "spec_version": "1.0",
        "architecture": kind,
        "num_classes": 2,
        "class_names": ["Other", "Tumor"],
        "patch_size_pixels": PATCH,
        "spacing_um_px": MPP,
        "transform": [
            {"name": "ToTensor"},
            {"name": "Normalize", "arguments": {"mean": MEAN, "std": STD}},
        ],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "model.pt"


def wsinfer(command: str, home: Path, *args: str) -> float:
    """Run a wsinfer command offline; its wall time."""
    (home / ".wsinfer-zoo").mkdir(parents=True, exist_ok=True)
    (home / ".wsinfer-zoo" / "wsinfer-zoo-registry.json").write_text('{"models": {}}')
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "WSINFER_FORCE_CPU": "1"}
    start = time.perf_counter()
    subprocess.run([command, *args], check=True, env=env, capture_output=True)
    return time.perf_counter() - start


def read_csvs(folder: Path) -> dict[str, dict[tuple[int, int], np.ndarray]]:
    tables = {}
    for path in sorted(folder.glob("*.csv")):
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        tables[path.stem] = {
            (round(float(r["minx"])), round(float(r["miny"]))): np.array(
                [float(r["prob_Other"]), float(r["prob_Tumor"])]
            )
            for r in rows
        }
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wsinfer", required=True, help="the wsinfer command (its own venv)")
    parser.add_argument("--slides", type=int, default=4)
    parser.add_argument("--width", type=int, default=8192, help="level-0 width of each slide")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", choices=["cheap", "cnn"], default="cheap")
    parser.add_argument("--min-tissue", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scratch")
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-bench-predict-")
    slides = scratch / "slides"
    slides.mkdir(exist_ok=True)
    for i in range(args.slides):
        synthetic_slide(slides / f"s{i}.svs", width=args.width, seed=400 + i, mpp=MPP)
    model = write_model(scratch / f"model-{args.model}", args.model)
    workers, batch = str(args.workers), str(args.batch_size)
    peer_total = peer_patch = ours_total = ours_infer = float("inf")
    peer_tiles = ours_tiles = 0
    for _ in range(args.repeats):  # interleaved: a slow spell hits both alike
        for name in ("theirs", "theirs-patch", "index", "ours"):
            shutil.rmtree(scratch / name, ignore_errors=True)
        peer_patch = min(peer_patch, wsinfer(
            args.wsinfer, scratch / "home", "patch", "--wsi-dir", str(slides), "--results-dir",
            str(scratch / "theirs-patch"), "--patch-size-px", str(PATCH),
            "--patch-spacing-um-px", str(MPP),
        ))  # fmt: skip
        peer_total = min(peer_total, wsinfer(
            args.wsinfer, scratch / "home", "run", "--wsi-dir", str(slides), "--results-dir",
            str(scratch / "theirs"), "--model-path", str(model), "--config",
            str(model.parent / "config.json"), "--batch-size", batch, "--num-workers", workers,
        ))  # fmt: skip
        start = time.perf_counter()
        index = build_index(
            [slides], scratch / "index", tile_size=PATCH, mpp=MPP, min_tissue=args.min_tissue
        )
        built = time.perf_counter()
        report = predict(
            index, str(model), scratch / "ours", batch_size=args.batch_size,
            workers=args.workers, device="cpu", heatmaps=False,
        )  # fmt: skip
        done = time.perf_counter()
        ours_total = min(ours_total, done - start)
        ours_infer = min(ours_infer, done - built)
        ours_tiles = report.tiles
    theirs = read_csvs(scratch / "theirs" / "model-outputs-csv")
    ours = read_csvs(scratch / "ours" / "model-outputs-csv")
    peer_tiles = sum(len(t) for t in theirs.values())
    shared = agree = 0
    worst = 0.0
    for name, table in theirs.items():
        for xy, probs in table.items():
            mine = ours.get(name, {}).get(xy)
            if mine is None:
                continue
            shared += 1
            gap = float(np.abs(mine - probs).max())
            worst = max(worst, gap)
            agree += gap <= 1e-4
    peer_infer = peer_total - peer_patch
    print(
        f"{args.slides} slides of {args.width} px, {PATCH} px patches at {MPP} um/px, model "
        f"{args.model} (TorchScript + WSInfer config), batch {args.batch_size}, "
        f"{args.workers} workers, CPU"
    )
    print(f"tiles: WSInfer {peer_tiles}, wsi_loader {ours_tiles}, at the same positions {shared}")
    for what, peer, mine in (
        ("whole command (tissue + inference)", peer_total, ours_total),
        ("inference alone", peer_infer, ours_infer),
    ):
        theirs_rate, ours_rate = peer_tiles / peer, ours_tiles / mine
        print(
            f"{what:<36} WSInfer {theirs_rate:7.0f} tiles/s  wsi_loader {ours_rate:7.0f} "
            f"tiles/s = {ours_rate / theirs_rate:.2f}x"
        )
    share = agree / shared if shared else float("nan")
    print(f"probabilities within 1e-4 where the grids coincide: {share:.4f} ({agree}/{shared}), "
          f"largest difference {worst:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
