"""Text cells of an export's CSV files are never spreadsheet formulas (OWASP's CSV injection):
a label or path starting with = + - @ gets a leading quote, numbers stay numbers, and
`csv_text` reads back what was exported."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

from tests.conftest import SlideFactory
from wsi_loader import build_index
from wsi_loader.export import export_index
from wsi_loader.files import csv_text


def test_labels_that_look_like_formulas_are_text_in_the_manifest(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(make_slide(width=768, height=512, seed=91), folder / "=cmd|calc!A0.svs")
    shutil.copy(make_slide(width=768, height=512, seed=92), folder / "b.svs")
    (folder / "labels.csv").write_text("slide,label\n=cmd|calc!A0,@SUM(1)\nb,-1\n")
    index = build_index(
        [folder], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0,
        labels=str(folder / "labels.csv"),
    )  # fmt: skip
    out = tmp_path / "export"
    export_index(index, out)
    with open(out / "manifest.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {row["label"] for row in rows} == {"'@SUM(1)", "'-1"}
    assert {csv_text(row["label"]) for row in rows} == {"@SUM(1)", "-1"}
    assert all(not row["slide_path"].startswith(("=", "+", "-", "@")) for row in rows)
    assert all(int(row["x"]) >= 0 and float(row["tile_mpp"]) > 0 for row in rows)
