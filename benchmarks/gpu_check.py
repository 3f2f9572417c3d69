"""The one prepared GPU check: CUDA tests, then the GPU benchmark, in one run.

    python3 benchmarks/gpu_check.py [--out DIR] [--tiles 6000] [--workers 0 4 8]

1. ``pytest -m cuda`` (pinned batches, DeviceLoader's side stream, nvJPEG decode).
2. Synthetic SVS slides -> index -> `wsi_loader.device._bench.run_bench` on the device: tiles/s of
   OpenSlide, our reader and make_loader per worker count, then the share of time the device
   waited for data behind a ResNet-50-sized step, with workers decoding JPEG (``decode="cpu"``)
   and with the decode on the GPU (``decode="device"``, nvJPEG through torchvision).
   The step is a real torchvision ResNet-50 forward + backward (bf16 autocast, channels_last)
   timed on this device; without torchvision, a fixed 50 ms.
3. On CUDA with torchvision: feature extraction (`wsi_loader.features.extract`) and whole-
   slide inference (`wsi_loader.predict`, every output written) behind a ResNet-50 in bf16,
   and the share of the wall time the GPU was busy with the model (CUDA events around each
   forward); target >= 90%.

Writes ``gpu_check.json`` and ``pytest.log`` under ``--out``. Runs on CPU too (``--device
cpu``), which is how it is smoke-tested where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import synthetic_slide

from wsi_loader.device._bench import format_table, run_bench
from wsi_loader.index import build_index


def resnet50_step_ms(device: str, batch: int, size: int) -> float | None:
    """Milliseconds of one ResNet-50 training step on ``device`` (None without torchvision)."""
    try:
        import torchvision
    except ImportError:
        return None
    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)

    def step() -> None:
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()

    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    start, repeats = time.perf_counter(), 10
    for _ in range(repeats):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def busy_share(
    index: Any, out: Path, batch: int, workers: int, command: str = "features"
) -> dict[str, Any] | None:
    """Run ResNet-50 (random weights: the time does not depend on them) in bf16 over the
    index, as ``features`` (the pooled features) or ``predict`` (a 2-class head; CSV, GeoJSON,
    heatmaps and slide results written as the command writes them), and measure the share of
    wall time the GPU spent in the model's forward passes."""
    try:
        import torchvision
    except ImportError:
        return None
    from wsi_loader.features import encoder_from, extract
    from wsi_loader.predict._run import predict

    class Timed(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.events: list[tuple[Any, Any]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y = self.inner(x)
            stop.record()
            self.events.append((start, stop))
            return y

    resnet = torchvision.models.resnet50()
    resnet.fc = torch.nn.Identity() if command == "features" else torch.nn.Linear(2048, 2)
    timed = Timed(resnet)
    encoder = encoder_from(
        (timed, {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225), "size": 224})
    )
    run = extract if command == "features" else predict
    start = time.perf_counter()
    report = run(
        index,
        encoder,
        out / command,
        batch_size=batch,
        workers=workers,
        dtype="bfloat16",
        device="cuda",
    )
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1000
    busy_ms = sum(a.elapsed_time(b) for a, b in timed.events)
    shutil.rmtree(out / command)  # only the reports come back
    return {
        "tiles": report.tiles,
        "tiles_per_s": round(report.tiles / wall_ms * 1000, 1),
        "gpu_busy_share": round(busy_ms / wall_ms, 3),
        "workers": workers,
        "batch_size": batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-check"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiles", type=int, default=6000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 4, 8])
    parser.add_argument("--slides", type=int, default=2)
    parser.add_argument("--slide-width", type=int, default=20_000)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "cpus": len(os.sched_getaffinity(0)),
    }
    print(json.dumps(report), flush=True)

    if not args.skip_tests:
        with open(out / "pytest.log", "w") as log:
            tests = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"],
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
            )
        report["cuda_tests_exit_code"] = tests.returncode
        print((out / "pytest.log").read_text()[-1500:], flush=True)

    scratch = out / "slides"
    scratch.mkdir(exist_ok=True)
    slides = [
        synthetic_slide(scratch / f"slide-{i}.svs", width=args.slide_width, seed=100 + i)
        for i in range(args.slides)
    ]
    index = build_index(slides, out / "index", tile_size=256, level=0, min_tissue=0.5)
    report["index_tiles"] = len(index)

    step_ms = resnet50_step_ms(args.device, args.batch_size, 256)
    report["resnet50_step_ms"] = None if step_ms is None else round(step_ms, 2)
    result = run_bench(
        index,
        tiles=args.tiles,
        batch_size=args.batch_size,
        workers=args.workers,
        device=args.device,
        step_ms=step_ms if step_ms is not None else 50.0,
    )
    report["bench"] = result
    print(format_table(result), flush=True)
    if args.device == "cuda":
        for command in ("features", "predict"):
            report[command] = busy_share(index, out, 256, max(args.workers), command)
            print(command, json.dumps(report[command]), flush=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    for path in scratch.iterdir():  # the slides stay behind: only the reports come back
        path.unlink()
    scratch.rmdir()


if __name__ == "__main__":
    main()
