"""Whole-slide inference as users type it: ``wsi-loader predict SLIDES`` against WSInfer's
``wsinfer run``, each a fresh process.

    .venv/bin/python benchmarks/bench_predict.py --wsinfer /work/wsinfer-venv/bin/wsinfer
        [--sets 2x2048,4x8192] [--rounds 3] [--workers 2] [--batch-size 64] [--model cheap|cnn]

WSInfer pins its own torch, torchvision and zarr 2, so it lives in its own virtual environment
(``--wsinfer`` names its command)::

    python3 -m venv /work/wsinfer-venv
    /work/wsinfer-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 wsinfer "zarr<3" \
        "tiffslide<3"

Both sides are one command in a new process, timed from its start to its exit: ours
``python -m wsi_loader.cli predict SLIDES --index-out IDX --model model.pt ...`` (the index
is built on the way, in the same process; a fresh index and output folder each round), theirs
``wsinfer run --wsi-dir SLIDES --results-dir OUT --model-path model.pt --config config.json``.
Both run the same TorchScript model with the same WSInfer config (patch size, spacing,
normalisation), on the same synthetic slides, CPU, same workers and batch size; ours writes no
heatmaps (WSInfer draws none). WSInfer loads its model zoo registry from the network when its
CLI starts: it is given an empty registry (in a scratch HOME) and ``HF_HUB_OFFLINE=1``; the
model is local, nothing is downloaded.

Start-up is reported apart, two ways per side: the subcommand's ``--help``, and a run over an
empty folder of slides (what the command costs before it has a slide to read: imports, model
loading where it comes first, the refusal). Each set of slides (``NxWIDTH``: N slides of WIDTH
level-0 px, 4:3) runs ``--rounds`` interleaved rounds, the side that goes first alternating;
best and median are printed. The grids: both start at (0, 0) and step one patch at the same
MPP; which tiles each keeps differs (WSInfer's Otsu-style segmentation of a thumbnail and tile
centres inside its polygons; our tissue fraction of each tile >= --min-tissue), so rates are
tiles per second of each side's own tiles, and agreement is measured on the positions both
have. ``cheap`` (global pool + linear) measures the data path; ``cnn`` a small convolutional
net, where the model's share grows on a CPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from common import scratch_folder, synthetic_slide
from torch import nn

REPO = Path(__file__).resolve().parents[1]
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


def timed(command: list[str], env: dict[str, str], check: bool = True) -> float:
    """Wall seconds of ``command`` as a new process, from its start to its exit."""
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if check and done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return elapsed


def wsinfer_env(home: Path) -> dict[str, str]:
    """WSInfer offline: an empty model zoo registry in a scratch HOME, no hub downloads."""
    (home / ".wsinfer-zoo").mkdir(parents=True, exist_ok=True)
    (home / ".wsinfer-zoo" / "wsinfer-zoo-registry.json").write_text('{"models": {}}')
    return {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "WSINFER_FORCE_CPU": "1"}


def stats(times: list[float]) -> str:
    return f"best {min(times):7.2f} s  median {statistics.median(times):7.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wsinfer", required=True, help="the wsinfer command (its own venv)")
    parser.add_argument(
        "--sets", default="2x2048,4x8192", help="NxWIDTH[,NxWIDTH]: N slides of WIDTH px each"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", choices=["cheap", "cnn"], default="cheap")
    parser.add_argument("--min-tissue", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch")
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-bench-predict-")
    model = write_model(scratch / f"model-{args.model}", args.model)
    config = model.parent / "config.json"
    peer_env = wsinfer_env(scratch / "home")
    our_env = {**os.environ, "PYTHONPATH": str(REPO)}
    ours_cmd = [sys.executable, "-m", "wsi_loader.cli", "predict"]
    workers, batch = str(args.workers), str(args.batch_size)

    def ours(slides: Path, out: Path) -> list[str]:
        return [
            *ours_cmd, str(slides), "--index-out", str(out.with_name(out.name + "-index")),
            "--model", str(model), "--out", str(out), "--tile-size", str(PATCH), "--mpp",
            str(MPP), "--min-tissue", str(args.min_tissue), "--batch-size", batch, "--workers",
            workers, "--device", "cpu", "--no-progress", "--no-heatmaps",
        ]  # fmt: skip

    def theirs(slides: Path, out: Path) -> list[str]:
        return [
            args.wsinfer, "run", "--wsi-dir", str(slides), "--results-dir", str(out),
            "--model-path", str(model), "--config", str(config), "--batch-size", batch,
            "--num-workers", workers,
        ]  # fmt: skip

    print(
        f"{PATCH} px patches at {MPP} um/px, model {args.model} (TorchScript + WSInfer config), "
        f"batch {args.batch_size}, {args.workers} workers, CPU, {args.rounds} interleaved rounds"
    )
    empty = scratch / "empty"
    empty.mkdir(exist_ok=True)
    start_up: dict[str, list[float]] = {k: [] for k in ("ours help", "theirs help", "ours empty",
                                                        "theirs empty")}  # fmt: skip
    for r in range(args.rounds):
        for side in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
            env = our_env if side == "ours" else peer_env
            base = ours_cmd if side == "ours" else [args.wsinfer, "run"]
            start_up[f"{side} help"].append(timed([*base, "--help"], env))
            out = scratch / f"{side}-empty-out"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.with_name(out.name + "-index"), ignore_errors=True)
            command = ours(empty, out) if side == "ours" else theirs(empty, out)
            start_up[f"{side} empty"].append(timed(command, env, check=False))
    print("start-up (a fresh process; no slide read):")
    for what in ("help", "empty"):
        label = "--help" if what == "help" else "an empty folder of slides"
        print(f"  {label:<28} WSInfer {stats(start_up[f'theirs {what}'])}")
        print(f"  {'':<28} wsi_loader {stats(start_up[f'ours {what}'])}")
    for spec in args.sets.split(","):
        count, width = (int(part) for part in spec.lower().split("x"))
        slides = scratch / f"slides-{count}x{width}"
        slides.mkdir(exist_ok=True)
        for i in range(count):
            synthetic_slide(slides / f"s{i}.svs", width=width, seed=400 + i, mpp=MPP)
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for r in range(args.rounds):  # interleaved, the first side alternating
            for side in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
                out = scratch / f"{side}-{spec}"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(out.with_name(out.name + "-index"), ignore_errors=True)
                command = ours(slides, out) if side == "ours" else theirs(slides, out)
                times[side].append(timed(command, our_env if side == "ours" else peer_env))
        peer = read_csvs(scratch / f"theirs-{spec}" / "model-outputs-csv")
        mine = read_csvs(scratch / f"ours-{spec}" / "model-outputs-csv")
        peer_tiles = sum(len(t) for t in peer.values())
        our_tiles = sum(len(t) for t in mine.values())
        shared = agree = 0
        worst = 0.0
        for name, table in peer.items():
            for xy, probs in table.items():
                found = mine.get(name, {}).get(xy)
                if found is None:
                    continue
                shared += 1
                gap = float(np.abs(found - probs).max())
                worst = max(worst, gap)
                agree += gap <= 1e-4
        print(f"{count} slides of {width} x {width * 3 // 4} px: tiles WSInfer {peer_tiles}, "
              f"wsi_loader {our_tiles}, at the same positions {shared}")  # fmt: skip
        print(f"  whole command  WSInfer    {stats(times['theirs'])}")
        print(f"                 wsi_loader {stats(times['ours'])}")
        for what, pick in (("best", min), ("median", statistics.median)):
            peer_rate = peer_tiles / pick(times["theirs"])
            our_rate = our_tiles / pick(times["ours"])
            print(
                f"  {what:<6} tiles/s WSInfer {peer_rate:7.0f}  wsi_loader {our_rate:7.0f} = "
                f"{our_rate / peer_rate:.2f}x (time ratio "
                f"{pick(times['theirs']) / pick(times['ours']):.2f}x)"
            )
        share = agree / shared if shared else float("nan")
        print(f"  probabilities within 1e-4 where the grids coincide: {share:.4f} "
              f"({agree}/{shared}), largest difference {worst:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
