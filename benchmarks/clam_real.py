"""CLAM's own feature-extraction data path, run by `bench_features.py --clam DIR` in a Python
that has CLAM's dependencies (torchvision, h5py, openslide, pandas: e.g. the torch 2.14.1 +
torchvision 0.29.1 venv docs/getting-started.md describes), never in this project's venv.

    PY benchmarks/clam_real.py --clam CLAM_CHECKOUT --job job.json

CLAM is not a package: ``--clam`` is a checkout of github.com/mahmoodlab/CLAM, imported from
there (nothing of it is copied here). What runs is CLAM's: its ``Whole_Slide_Bag_FP`` dataset
(coordinates from a ``create_patches_fp`` h5, OpenSlide ``read_region``, RGB), its
``get_eval_transforms`` (Resize, ToTensor, Normalize with its ImageNet constants) and its
``save_hdf5`` (features appended batch by batch). The loop around them does what
``extract_features_fp.py`` does per slide (its script parses arguments on import, so it is
not imported): open the slide, a new DataLoader, the model under inference mode, the outputs
appended to an h5 per slide. The model is this project's benchmark model, so both sides run
the same one. Prints one JSON line: tiles, wall seconds and CPU seconds of the slide loop
(this process and its ended workers), start-up and imports left out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clam", required=True, help="a checkout of mahmoodlab/CLAM")
    parser.add_argument("--job", required=True, help="JSON: slides, coords, out, batch, ...")
    args = parser.parse_args()
    job = json.loads(Path(args.job).read_text())
    sys.path.insert(0, str(Path(args.clam).resolve()))
    import openslide
    from bench_models import make_model  # the model both sides run
    from dataset_modules.dataset_h5 import Whole_Slide_Bag_FP  # CLAM's
    from utils.constants import MODEL2CONSTANTS  # CLAM's
    from utils.file_utils import save_hdf5  # CLAM's
    from utils.transform_utils import get_eval_transforms  # CLAM's

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    constants = MODEL2CONSTANTS["resnet50_trunc"]
    transforms = get_eval_transforms(constants["mean"], constants["std"], job["patch_size"])
    model = make_model(job["model"])
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    tiles = 0
    start, used = time.perf_counter(), cpu_seconds()
    for name, slide in job["slides"].items():
        target = out / f"{name}.h5"
        target.unlink(missing_ok=True)
        with contextlib.redirect_stdout(io.StringIO()):  # its dataset prints a summary
            dataset = Whole_Slide_Bag_FP(
                file_path=str(Path(job["coords"]) / f"{name}.h5"),
                wsi=openslide.open_slide(slide),
                img_transforms=transforms,
            )
        loader = DataLoader(dataset, batch_size=job["batch"], num_workers=job["workers"])
        mode = "w"
        with torch.inference_mode():
            for item in loader:
                features = model(item["img"]).numpy().astype(np.float32)
                coords = item["coord"].numpy().astype(np.int32)
                save_hdf5(str(target), {"features": features, "coords": coords}, mode=mode)
                mode = "a"
        tiles += len(dataset)
    wall = time.perf_counter() - start
    print(json.dumps({"tiles": tiles, "wall": wall, "cpu": cpu_seconds() - used}))


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


if __name__ == "__main__":
    main()
