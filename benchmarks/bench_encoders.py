"""A registry encoder over the same tiles through ours (``wsi-loader features --model NAME``),
TRIDENT's patch feature extraction (``Processor.run_patch_feature_extraction_job`` with its
own ``encoder_factory`` encoder) and LazySlide's ``feature_extraction``: each a fresh process,
in interleaved rounds; tiles/s (best and median), CPU per tile, and the features checked equal.

    make bench-encoders ARGS="--tiles 256 --rounds 3"
    .venv-peers-enc/bin/python benchmarks/bench_encoders.py [--model kaiko_vits16] [--tiles 256]
        [--rounds 3] [--batch-size 32] [--workers 2] [--peer-python PY] [--ours-python PY]

The encoder needs no download on any side: seeded random weights are written once in the hub
file's layout and handed to each the way it takes a local file (ours ``--weights``, TRIDENT
``encoder_factory(name, weights_path=...)``; LazySlide takes a module: timm's model with the same
file as ``checkpoint_path`` and a transform of the card's mean/std). The tiles are ours: the
index's coordinates go to TRIDENT as its coords h5 and to LazySlide as its tiles table, so
all three read the same windows at the encoder's resolution (224 px tiles: no resize).

Tiles/s counts the whole process (imports, model, reading, writing), as a user meets it;
``extract`` is the peers' own call alone. The ``model`` side is the ceiling no loader can pass:
a fresh process (ours' Python) that imports torch, builds the same encoder from the same file
and runs its forward pass (preprocessing included) over as many tiles, in the same batches and
torch threads, on tensors already in memory: nothing read, decoded or written. Its ``extract``
is the forward passes alone. The peers are no dependency of ours: they live in
their own venv (``make bench-encoders``; TRIDENT and CONCH from their git checkouts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

REPO = Path(__file__).resolve().parents[1]
TRIDENT_NAMES = {
    "kaiko_vits16": "kaiko-vits16",
    "kaiko_vitb16": "kaiko-vitb16",
    "kaiko_vitl14": "kaiko-vitl14",
}


def seeded_weights(name: str, path: Path, seed: int = 0) -> None:
    """The encoder's timm state dict with seeded random weights (layer norms near one)."""
    import torch

    from wsi_loader.models import ENCODERS
    from wsi_loader.models._encoders import build

    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in build(ENCODERS[name], device="cpu").backbone.state_dict().items():
        new = torch.randn(value.shape, generator=generator) * 0.02
        if key.endswith(("norm1.weight", "norm2.weight", "norm.weight")):
            new = new + 1
        state[key] = new if value.is_floating_point() else value
    torch.save(state, path)


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The slide, our index, the weights, TRIDENT's coords file; the tiles' coordinates."""
    sys.path.insert(0, str(Path(__file__).parent))
    from common import synthetic_slide

    from wsi_loader.index import build_index
    from wsi_loader.models import ENCODERS

    recipe = ENCODERS[args.model]
    size = recipe.size or recipe.patch_size
    side = math.ceil(math.sqrt(args.tiles * 4 / 3))  # a 4:3 slide with about --tiles tiles
    slides = work / "slides"
    slides.mkdir(exist_ok=True)
    slide = synthetic_slide(slides / "s0.svs", width=side * size, seed=0, mpp=recipe.mpp)
    index = build_index([slides], work / "idx", tile_size=size, mpp=recipe.mpp, min_tissue=0.0)
    weights = work / "pytorch_model.bin"
    if not weights.exists():
        seeded_weights(args.model, weights)
    # our pass once (untimed): its coordinates are the tiles every side reads
    out = work / "coords-run"
    shutil.rmtree(out, ignore_errors=True)
    run_ours(args, index.path, weights, out)
    with h5py.File(out / "s0.h5", "r") as h5:
        coords = h5["coords"][:]
    patches = work / "trident" / "coords" / "patches"
    patches.mkdir(parents=True, exist_ok=True)
    with h5py.File(patches / "s0_patches.h5", "w") as h5:
        ds = h5.create_dataset("coords", data=coords.astype(np.int64))
        mag = round(10 / recipe.mpp)
        ds.attrs.update(patch_size=size, level0_magnification=mag, target_magnification=mag)
    np.save(work / "coords.npy", coords)
    return {
        "slide": str(slide), "index": str(index.path), "weights": str(weights),
        "coords": coords, "size": size, "mean": recipe.mean, "std": recipe.std,
    }  # fmt: skip


def run_ours(args: argparse.Namespace, index: Path, weights: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [
        args.ours_python, "-m", "wsi_loader.cli", "features", str(index), "--model", args.model,
        "--weights", str(weights), "--out", str(out), "--workers", str(args.workers),
        "--batch-size", str(args.batch_size), "--device", "cpu", "--no-progress",
    ]  # fmt: skip
    subprocess.run(command, check=True, env=env, capture_output=True, text=True)


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall and CPU seconds (the process and the workers it waited for) and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def one_round(
    side: str, args: argparse.Namespace, work: Path, spec: dict[str, Any]
) -> tuple[float, float, float | None, np.ndarray | None]:
    """One fresh process of ``side``: wall, CPU, the peer's own extract seconds, features
    (rows in the order of ``spec["coords"]``; none for the model-only ceiling)."""
    out = work / f"out-{side}"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    if side == "model":
        child = {
            "side": side, "weights": spec["weights"], "model": args.model, "size": spec["size"],
            "tiles": len(spec["coords"]), "batch_size": args.batch_size,
        }  # fmt: skip
        command = [args.ours_python, __file__, "--child", json.dumps(child)]
    elif side == "ours":
        command = [
            args.ours_python, "-m", "wsi_loader.cli", "features", spec["index"], "--model",
            args.model, "--weights", spec["weights"], "--out", str(out), "--workers",
            str(args.workers), "--batch-size", str(args.batch_size), "--device", "cpu",
            "--no-progress",
        ]  # fmt: skip
    else:
        shutil.rmtree(work / "trident" / "coords" / f"features_{TRIDENT_NAMES[args.model]}", True)
        child = {
            "side": side, "work": str(work), "out": str(out), "weights": spec["weights"],
            "slide": spec["slide"], "model": args.model, "size": spec["size"],
            "mean": spec["mean"], "std": spec["std"], "batch_size": args.batch_size,
            "workers": args.workers,
        }  # fmt: skip
        command = [args.peer_python, __file__, "--child", json.dumps(child)]
    wall, cpu, stdout = timed(command, env)
    extract = json.loads(stdout.strip().splitlines()[-1])["extract_s"] if side != "ours" else None
    if side == "model":
        return wall, cpu, extract, None
    if side in ("ours", "trident"):
        features, coords = read_h5(out / "s0.h5")
    else:
        features, coords = np.load(out / "features.npy"), spec["coords"]
    return wall, cpu, extract, in_order(features, coords, spec["coords"])


def read_h5(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as h5:
        return np.asarray(h5["features"][:]).reshape(-1, h5["features"].shape[-1]), h5["coords"][:]


def in_order(features: np.ndarray, coords: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    row = {(int(x), int(y)): i for i, (x, y) in enumerate(coords)}
    return features[[row[(int(x), int(y))] for x, y in wanted]]


def child_trident(spec: dict[str, Any]) -> float:
    from trident import Processor
    from trident.patch_encoder_models import encoder_factory

    work = Path(spec["work"]) / "trident"
    processor = Processor(
        job_dir=str(work), wsi_source=str(Path(spec["slide"]).parent), wsi_ext=[".svs"],
        max_workers=spec["workers"], reader_type="openslide",
    )  # fmt: skip
    encoder = encoder_factory(TRIDENT_NAMES[spec["model"]], weights_path=spec["weights"])
    start = time.perf_counter()
    saved = processor.run_patch_feature_extraction_job(
        coords_dir="coords", patch_encoder=encoder, device="cpu",
        batch_limit=spec["batch_size"],
    )  # fmt: skip
    extract = time.perf_counter() - start
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(saved) / "s0.h5", Path(spec["out"]) / "s0.h5")
    return extract


def child_model(spec: dict[str, Any]) -> float:
    """The encoder's forward passes alone over ``tiles`` tiles already in memory."""
    import torch

    from wsi_loader.models import encoder

    module = encoder(spec["model"], spec["weights"], download=False)
    generator = torch.Generator().manual_seed(0)
    size, total, batch = spec["size"], spec["tiles"], spec["batch_size"]
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, total, batch):
            n = min(batch, total - first)
            module(torch.rand((n, 3, size, size), generator=generator))
    return time.perf_counter() - start


def child_lazyslide(spec: dict[str, Any]) -> float:
    import lazyslide as zs
    import timm
    import torch
    from torchvision.transforms import v2
    from wsidata import TileSpec, open_wsi
    from wsidata.io import add_tiles

    from wsi_loader.models import ENCODERS

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    wsi = open_wsi(spec["slide"], store=str(out / "s0.zarr"), reader="openslide")
    coords = np.load(Path(spec["work"]) / "coords.npy")
    tiles = TileSpec.from_wsidata(wsi, tile_px=spec["size"], mpp=ENCODERS[spec["model"]].mpp)
    add_tiles(wsi, "tiles", coords, tiles, tissue_ids=np.zeros(len(coords), dtype=int))
    recipe = ENCODERS[spec["model"]]
    model = timm.create_model(recipe.model, checkpoint_path=spec["weights"], **recipe.kwargs).eval()
    transform = v2.Compose(
        [
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(spec["mean"], spec["std"]),
        ]
    )
    start = time.perf_counter()
    features = zs.tl.feature_extraction(
        wsi, model, transform=transform, device="cpu", batch_size=spec["batch_size"],
        num_workers=spec["workers"], pbar=False, return_features=True,
    )  # fmt: skip
    extract = time.perf_counter() - start
    np.save(out / "features.npy", np.asarray(features))
    return extract


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="kaiko_vits16", choices=sorted(TRIDENT_NAMES))
    parser.add_argument("--tiles", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sides", default="ours,trident,lazyslide,model")
    parser.add_argument("--peer-python", default=sys.executable)
    parser.add_argument("--ours-python", default=sys.executable)
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        run = {"trident": child_trident, "lazyslide": child_lazyslide, "model": child_model}[
            spec["side"]
        ]
        print(json.dumps({"extract_s": run(spec)}))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import scratch_folder

    work = scratch_folder(args.scratch, "bench-encoders-")
    spec = prepare(args, work)
    n = len(spec["coords"])
    sides = args.sides.split(",")
    load = [os.getloadavg()[0]]
    results: dict[str, list[tuple[float, float, float | None]]] = {s: [] for s in sides}
    features: dict[str, np.ndarray] = {}
    for r in range(args.rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]  # interleaved, rotated
        for side in order:
            wall, cpu, extract, feats = one_round(side, args, work, spec)
            results[side].append((wall, cpu, extract))
            if feats is not None:
                features[side] = feats
            load.append(os.getloadavg()[0])
            print(
                f"round {r + 1} {side:9s} {n / wall:7.1f} tiles/s  wall {wall:6.1f} s", flush=True
            )
    print(
        f"\n{args.model}, {n} tiles of {spec['size']} px, batch {args.batch_size}, "
        f"{args.workers} workers, CPU, {args.rounds} interleaved rounds; 1-min load "
        f"{min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores"
    )
    print("| side | tiles/s best | median | CPU ms/tile (median) | extract call best (s) |"
          " max abs diff vs ours |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    best = {s: max(n / w for w, _, _ in results[s]) for s in sides}
    median = {s: statistics.median(n / w for w, _, _ in results[s]) for s in sides}
    for side in sides:
        cpu = statistics.median(c for _, c, _ in results[side]) / n * 1000
        extracts = [e for _, _, e in results[side] if e is not None]
        call = f"{min(extracts):.1f}" if extracts else "-"
        diff = "-"
        if side in features and side != "ours" and "ours" in features:
            diff = f"{np.abs(features[side] - features['ours']).max():.2e}"
        print(f"| {side} | {best[side]:.1f} | {median[side]:.1f} | {cpu:.0f} | {call} | {diff} |")
    if "ours" in sides:
        for side in sides:
            if side == "model":
                print(
                    f"ours / model-only ceiling (whole process): {best['ours'] / best[side]:.2f}x"
                    f" best, {median['ours'] / median[side]:.2f}x median"
                )
            elif side != "ours":
                print(
                    f"ours / {side}: {best['ours'] / best[side]:.2f}x best, "
                    f"{median['ours'] / median[side]:.2f}x median"
                )


if __name__ == "__main__":
    main()
