"""Stain normalisation throughput: this library's batched maps with slide vectors against the peers.

    .venv/bin/python benchmarks/bench_stain.py [--tiles 256] [--batch-size 64] [--device cpu]
        [--skip-loader] [--real SLIDE ...] [--model-scale]

On the same tiles (256 px, from synthetic slides stained with known vectors), in one run:

- ``ours slide map``: `wsi_loader.stain.Normalize("macenko" | "reinhard")` with each slide's
  values estimated once, at index time, whole batches; numpy (OpenCV) is what DataLoader
  workers run, torch what `DeviceLoader` runs on ``--device``. Not the work torchstain does.
- ``ours per tile``: ``Normalize(..., per_tile=True)``, estimating every tile as torchstain
  does: the same work, the row to compare with it.
- ``torchstain per tile``: torchstain's Macenko / Reinhard (torch backend), one tile at a time,
  as its README does it (a fit per tile inside ``normalize``), with 1 and with 2 torch threads
  (ratios are to the faster).
- ``torch-staintools``: its batched Macenko (least-squares concentrations) estimating every
  tile, and with its stain-matrix cache keyed by slide (its nearest to slide vectors); Reinhard
  batched. Needs torchvision; skipped (with the reason) when it cannot be imported.
- make_loader throughput with and without normalisation in the workers (the CPU path), and
  where its cost comes from: one process's CPU per tile to read (decode) a batch and to
  normalise it, on the synthetic archive and on any ``--real SLIDE`` (tiles as they decode from a
  real scanner's JPEGs; e.g. ``$WSI_LOADER_TEST_DATA/CMU-1-Small-Region.svs``).
- what it costs a whole run: `wsi_loader.predict` with a small CNN (bench_predict.py's)
  on ``--device``, with and without normalisation (on a CPU the map runs in the process that runs
  the model; on a GPU, on the device), and for scale a ResNet-18's forward per tile on
  ``--device`` (``--model-scale`` prints only that).

Prints tiles/s and ratios to torchstain per tile at its best thread count.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import scratch_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wsi_loader.dataset import TileDataset, make_loader
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.slides._open import open_slide
from wsi_loader.stain import Normalize, resolve_target
from wsi_loader.synthetic import SlideSpec, write_svs

STAINS = (
    ((0.5626, 0.7201, 0.4062), (0.2159, 0.8012, 0.5581)),
    ((0.65, 0.70, 0.29), (0.30, 0.80, 0.45)),
)


def best_rate(fn: Callable[[], Any], tiles: int, repeats: int) -> float:
    fn()  # warm-up (OpenCV tables, torch kernels)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return tiles / best


def archive(folder: Path, width: int) -> SlideIndex:
    for i, stain in enumerate(STAINS):
        spec = SlideSpec(width, int(width * 0.75), seed=20 + i, stain=stain)
        write_svs(str(folder / f"s{i}.svs"), spec)
    return build_index([folder], folder / "idx", tile_size=256, level=0, min_tissue=0.5)


def torchstain_rates(method: str, target: np.ndarray, pixels: np.ndarray, reps: int) -> float:
    import torchstain

    chw = [torch.from_numpy(t).permute(2, 0, 1) for t in pixels]
    if method == "macenko":
        normalizer = torchstain.normalizers.MacenkoNormalizer(backend="torch")
        normalizer.fit(torch.from_numpy(target).permute(2, 0, 1))

        def run() -> None:
            for tile in chw:
                normalizer.normalize(tile, stains=False)

    else:
        normalizer = torchstain.normalizers.ReinhardNormalizer(backend="torch")
        normalizer.fit(torch.from_numpy(target).permute(2, 0, 1))

        def run() -> None:
            for tile in chw:
                normalizer.normalize(tile)

    return best_rate(run, len(pixels), reps)


def staintools_rates(
    method: str, target: np.ndarray, pixels: np.ndarray, slide_ids: np.ndarray, args: Any
) -> dict[str, float] | str:
    try:
        from torch_staintools.normalizer import NormalizerBuilder
    except Exception as exc:  # not installed, or its torchvision does not import
        return f"torch-staintools not importable ({type(exc).__name__}: {exc})"
    device = torch.device(args.device)
    unit = torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div(255).to(device)
    fit = torch.from_numpy(target).permute(2, 0, 1)[None].float().div(255).to(device)
    batches = [unit[i : i + args.batch_size] for i in range(0, len(unit), args.batch_size)]
    rates: dict[str, float] = {}
    if method == "reinhard":
        norm = NormalizerBuilder.build("reinhard").to(device)
        norm.fit(fit)
        rates["batched"] = best_rate(lambda: [norm(b) for b in batches], len(pixels), args.repeats)
        return rates
    norm = NormalizerBuilder.build("macenko", concentration_solver="ls").to(device)
    norm.fit(fit)
    rates["batched"] = best_rate(lambda: [norm(b) for b in batches], len(pixels), args.repeats)
    cached = NormalizerBuilder.build(
        "macenko", concentration_solver="ls", use_cache=True, device=device
    ).to(device)
    cached.fit(fit)
    keys = [[f"slide{int(s)}" for s in slide_ids[i : i + args.batch_size]] for i in
            range(0, len(unit), args.batch_size)]  # fmt: skip
    rates["cache by slide"] = best_rate(
        lambda: [cached(b, cache_keys=k) for b, k in zip(batches, keys, strict=True)],
        len(pixels),
        args.repeats,
    )
    return rates


def loader_rate(index: SlideIndex, args: Any, stain: Any) -> float:
    loader = make_loader(
        index, batch_size=args.batch_size, num_workers=args.workers, stain=stain, seed=0
    )
    best = 0.0
    for epoch in range(args.repeats + 1):
        loader.set_epoch(epoch)
        start, count = time.perf_counter(), 0
        for batch in loader:
            count += len(batch)
        if epoch:  # the first epoch starts the workers
            best = max(best, count / (time.perf_counter() - start))
    return best


def per_tile_costs(index: SlideIndex, args: Any, label: str) -> None:
    """One process: us of CPU per tile to read a batch (decode) and to normalise it in place,
    and the throughput cost normalising in the workers would have (map / (read + map))."""
    cols = index.columns
    rows = np.flatnonzero(cols["tissue"] >= 0.5)
    rows = np.random.default_rng(1).choice(rows, min(args.tiles, len(rows)), replace=False)
    rows = np.sort(rows)  # the order a loader reads a shard in
    slide_ids = np.asarray(cols["slide_id"][rows], dtype=np.int64)
    reader = TileDataset(index).reader
    parts = [slice(i, i + args.batch_size) for i in range(0, len(rows), args.batch_size)]
    read_s = 1 / best_rate(lambda: [reader.read(rows[p]) for p in parts], len(rows),
                                   args.repeats)  # fmt: skip
    pixels = reader.read(rows).pixels.copy()
    print(f"{label}: {len(rows)} tiles, read {1e6 * read_s:.0f} us/tile (one process)")
    for method in ("macenko", "reinhard"):
        op = Normalize(method, target=resolve_target(pixels[0])).bind(index)

        def run(op: Normalize = op) -> None:
            for p in parts:
                op.apply_numpy(pixels[p].copy(), slide_ids[p], rows[p])

        map_s = 1 / best_rate(run, len(rows), args.repeats)
        print(f"  {method}: {1e6 * map_s:.0f} us/tile, a cost of "
              f"{100 * map_s / (read_s + map_s):.0f}% on reading")  # fmt: skip


def small_cnn() -> torch.nn.Module:
    """bench_predict.py's small CNN: three strided convolutions, pool, linear."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=4), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 2),
    ).eval()  # fmt: skip


def resnet18_ms(device: torch.device, batch: int = 16) -> float:
    """ms per 256 px tile of a ResNet-18 forward (written out: torchvision is optional)."""
    from torch import nn

    class Basic(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
            )  # fmt: skip
            self.skip: nn.Module = nn.Identity()
            if stride != 1 or cin != cout:
                self.skip = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.body(x) + self.skip(x))

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(), nn.MaxPool2d(3, 2, 1)]  # fmt: skip
    width = 64
    for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Basic(width, out, stride), Basic(out, out, 1)]
        width = out
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 2))
    net = net.eval().to(device)
    x = torch.rand(batch, 3, 256, 256, device=device)

    def run() -> None:
        with torch.inference_mode():
            net(x)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return 1e3 / best_rate(run, batch, 3)


def predict_rates(index: SlideIndex, args: Any, folder: Path) -> dict[str, float]:
    """tiles/s of whole predict runs (best of ``--repeats``, the ways interleaved)."""
    from wsi_loader.predict._run import predict

    ways = {"none": None, "macenko": Normalize("macenko"), "reinhard": Normalize("reinhard")}
    best = dict.fromkeys(ways, 0.0)
    model = small_cnn()
    for _ in range(args.repeats):
        for name, stain in ways.items():
            out = folder / "predict"
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            report = predict(
                index, model, out, workers=args.workers, heatmaps=False, stain=stain,
                device=args.device, batch_size=args.batch_size,
            )  # fmt: skip
            best[name] = max(best[name], report.tiles / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=8192, help="level-0 width of each slide")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2, help="make_loader's workers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-loader", action="store_true")
    parser.add_argument(
        "--real", action="append", default=[], metavar="SLIDE",
        help="also the CPU per tile to read and normalise this slide's tiles (repeatable)",
    )  # fmt: skip
    parser.add_argument("--tmp", help="scratch folder (default: a temporary one)")
    parser.add_argument(
        "--model-scale", action="store_true", help="only a ResNet-18's forward time per tile"
    )
    args = parser.parse_args()
    if args.model_scale:
        print(f"ResNet-18 forward, 256 px, batch 16, {torch.get_num_threads()} torch threads, "
              f"{args.device}: {resnet18_ms(torch.device(args.device)):.1f} ms/tile")  # fmt: skip
        return
    folder = scratch_folder(args.tmp, "bench-stain-")
    index = archive(folder, args.width)
    cols = index.columns
    rows = np.flatnonzero(cols["tissue"] >= 0.5)
    rows = np.random.default_rng(0).choice(rows, min(args.tiles, len(rows)), replace=False)
    pixels = TileDataset(index).reader.read(rows).pixels.copy()
    slide_ids = np.asarray(cols["slide_id"][rows], dtype=np.int64)
    target_tile = pixels[0]
    device = torch.device(args.device)
    print(
        f"{len(pixels)} tiles of 256 px from {len(index.slides)} slides, batches of "
        f"{args.batch_size}, torch threads {torch.get_num_threads()}, device {device}"
    )
    print(f"{'method':9} {'way':44} {'tiles/s':>9} {'vs torchstain':>14}")
    threads = torch.get_num_threads()
    for method in ("macenko", "reinhard"):
        peers: dict[int, float] = {}
        for n in sorted({1, 2}):  # torchstain at its best thread count
            torch.set_num_threads(n)
            peers[n] = torchstain_rates(method, target_tile, pixels, args.repeats)
        torch.set_num_threads(threads)
        peer = max(peers.values())
        ways = {f"torchstain per tile (torch, {n} thread{'s' * (n > 1)})": rate
                for n, rate in peers.items()}  # fmt: skip
        for per_tile in (True, False):
            op = Normalize(method, target=resolve_target(target_tile), per_tile=per_tile)
            op = op.bind(index)

            def numpy_path(op: Normalize = op) -> None:
                for i in range(0, len(pixels), args.batch_size):
                    batch = pixels[i : i + args.batch_size].copy()
                    op.apply_numpy(batch, slide_ids[i : i + args.batch_size],
                                   rows[i : i + args.batch_size])  # fmt: skip

            on_device = torch.from_numpy(pixels).to(device)

            def torch_path(op: Normalize = op, images: torch.Tensor = on_device) -> None:
                for i in range(0, len(pixels), args.batch_size):
                    part = slice(i, i + args.batch_size)
                    op.apply_torch(images[part], slide_ids[part], rows[part])
                if device.type == "cuda":
                    torch.cuda.synchronize()

            what = "per tile (per_tile=True)" if per_tile else "slide map (index-time vectors)"
            ways[f"ours {what}, numpy"] = best_rate(numpy_path, len(pixels), args.repeats)
            ways[f"ours {what}, torch {device.type}"] = best_rate(
                torch_path, len(pixels), args.repeats
            )
        tools = staintools_rates(method, target_tile, pixels, slide_ids, args)
        if isinstance(tools, str):
            print(f"  ({tools})")
        else:
            ways.update({f"torch-staintools {k} ({device.type})": v for k, v in tools.items()})
        for way, rate in ways.items():
            print(f"{method:9} {way:44} {rate:9.0f} {rate / peer:13.1f}x")
    if not args.skip_loader:
        print("CPU per tile, one process:")
        per_tile_costs(index, args, "  synthetic archive")
        for i, slide in enumerate(args.real):
            with open_slide(slide) as reader:  # tiles on storage tiles: one decode each
                size = reader.meta.tile_sizes[0][0] if reader.meta.tile_sizes else 0
            real = build_index([slide], folder / f"real{i}", tile_size=size or 256, level=0)
            per_tile_costs(real, args, f"  {Path(slide).name}")
        base = loader_rate(index, args, None)
        print(f"make_loader, {args.workers} workers, {len(index)} tiles per epoch:")
        print(f"  no stain: {base:.0f} tiles/s")
        for method in ("macenko", "reinhard"):
            rate = loader_rate(index, args, Normalize(method))
            print(f"  {method}: {rate:.0f} tiles/s (cost {100 * (1 - rate / base):.0f}%)")
        rates = predict_rates(index, args, folder)
        print(f"predict, small CNN on {device}, {args.workers} workers:")
        for name, rate in rates.items():
            cost = 100 * (1 - rate / rates["none"])
            print(
                f"  stain {name}: {rate:.0f} tiles/s"
                + (f" (cost {cost:.0f}%)" if name != "none" else "")
            )
        print(f"for scale, a ResNet-18 forward: {resnet18_ms(device):.1f} ms/tile")


if __name__ == "__main__":
    main()
