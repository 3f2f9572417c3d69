"""The read path never calls into torch's intra-op thread pool. Its threads spin waiting for
cores that other processes hold: small copies then cost 5-10x on a busy machine. Checked in a
fresh process: with torch set to 2 threads, the pool's threads appear at the first parallel
torch operation and stay, so a thread count that does not grow proves none ran."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, SlideFactory

SCRIPT = """
import os, sys, threading, time
import torch
torch.set_num_threads(2)
import wsi_loader as wl
from wsi_loader.export import export_index
from wsi_loader.device._loader import DeviceLoader

def threads():  # native threads: all of the process's, less those Python started (tqdm's...)
    return len(os.listdir("/proc/self/task")) - threading.active_count()

def grown():
    # a decode thread that Python has joined may linger in /proc for a moment; torch's pool
    # threads never leave, so waiting a little cannot hide them
    for _ in range(200):
        extra = threads() - base
        if extra <= 0:
            return extra
        time.sleep(0.01)
    return extra

index = wl.SlideIndex.open(sys.argv[1])
ds = wl.TileDataset(index)
base = threads()
steps = {
    "item": lambda: ds[0],
    "getitems": lambda: ds.__getitems__(list(range(8))),
    "read_batch": lambda: ds.read_batch(list(range(16))),
    "bag": lambda: wl.SlideBagDataset(index, k=6)[0],
    "make_loader": lambda: list(wl.make_loader(index, batch_size=16, num_workers=0)),
    "device_loader_cpu": lambda: list(
        DeviceLoader(wl.make_loader(index, batch_size=16, num_workers=0), "cpu")
    ),
    "device_decode_cpu": lambda: list(
        DeviceLoader(
            wl.make_loader(index, batch_size=16, num_workers=0, decode="device"), "cpu"
        )
    ),
    "export": lambda: export_index(index, sys.argv[2], shard_size=16),
}
for name, step in steps.items():
    step()
    print(name, grown(), flush=True)
big = torch.ones(64, 256, 256, 3, dtype=torch.uint8)
big.permute(0, 3, 1, 2).contiguous()
print("control", threads() - base, flush=True)
"""


def test_reads_never_start_torch_intra_op_threads(make_slide: SlideFactory, tmp_path: Path) -> None:
    from wsi_loader import build_index

    slide = make_slide(width=2048, height=2048, seed=3)
    labels = tmp_path / "labels.csv"  # (image folders hold labelled tiles)
    labels.write_text(f"slide,label\n{slide.stem},tissue\n")
    index = build_index([slide], tmp_path / "idx", level=0, min_tissue=0, labels=str(labels))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(index.path), str(tmp_path / "export")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    grown = dict(line.split() for line in done.stdout.splitlines())
    control = int(grown.pop("control"))
    assert control > 0, "the check must see torch's pool when it does start"
    assert {name: int(n) for name, n in grown.items()} == dict.fromkeys(grown, 0)
