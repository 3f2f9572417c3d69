"""An export resumed after a rebuild writes again the units of a slide whose tile in the
middle was re-encoded (size, first and last 64 KiB and mtime kept), and keeps those of a
slide only touched."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.conftest import SlideFactory
from tests.index.slide_rewrites import rewrite_keeping_mtime
from wsi_loader.export import export_index
from wsi_loader.index import build_index

OPTIONS = {"tile_size": 256, "level": 1, "min_tissue": 0.0}


def test_an_export_resumed_after_a_rebuild_writes_again_the_units_of_a_rewritten_slide(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copyfile(make_slide(width=4096, height=4096, seed=71), folder / "a.svs")
    shutil.copyfile(make_slide(width=4096, height=4096, seed=77), folder / "b.svs")
    out = tmp_path / "export"

    def export() -> tuple[int, int]:
        index = build_index([folder], tmp_path / "idx", **OPTIONS)
        report = export_index(index, out, format="webdataset", shard_size=8)
        return report.units, report.units_skipped

    assert export() == (4, 0)  # 16 tiles of each slide, 8 a unit
    os.utime(folder / "b.svs", ns=(10**18, 10**18))  # touched: the same slide
    assert export() == (4, 4)
    rewrite_keeping_mtime(folder / "a.svs", "reencode")
    assert export() == (4, 2)  # the units of a.svs are written again
