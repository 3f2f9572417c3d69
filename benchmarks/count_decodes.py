"""Decodes per storage tile of a whole-slide pass (`extract`, cheap model, CPU): how often each
storage tile of the slides is decoded when windows share them (a 224 px grid over 256 px
storage tiles). Each slide is read in strips, one run per worker, so that it is ~1.

    .venv/bin/python benchmarks/bench_features.py --slides 1 --width 49152 --scratch S
    .venv/bin/python benchmarks/count_decodes.py S/index-224 [--workers 2 4]

The TIFF reader's decoder is wrapped to log each decode (forked workers inherit the wrapper).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.feature_models import MeanLinear
from wsi_loader.features import encoder_from, extract
from wsi_loader.index import SlideIndex
from wsi_loader.slides import _tiff

_decoder = _tiff.TiffReader._decoder


def _counted(self: _tiff.TiffReader, level: int, index: int, scale: int) -> Any:
    decode = _decoder(self, level, index, scale)

    def run() -> Any:
        with open(os.environ["DECODE_LOG"], "a") as fh:
            fh.write(f"{self.path} {level} {index} {scale}\n")
        return decode()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("index")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    _tiff.TiffReader._decoder = _counted  # type: ignore[method-assign]
    index = SlideIndex.open(args.index)
    encoder = encoder_from(
        (MeanLinear(), {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)})
    )
    for workers in args.workers:
        with tempfile.TemporaryDirectory() as scratch:
            log = Path(scratch) / "decodes.log"
            log.write_text("")
            os.environ["DECODE_LOG"] = str(log)
            report = extract(index, encoder, Path(scratch) / "f", workers=workers, device="cpu")
            counts = collections.Counter(log.read_text().splitlines())
        decodes = sum(counts.values())
        print(
            f"workers {workers}: {report.tiles} tiles, {decodes} decodes of {len(counts)} "
            f"storage tiles = {decodes / len(counts):.2f} per storage tile"
        )


if __name__ == "__main__":
    main()
