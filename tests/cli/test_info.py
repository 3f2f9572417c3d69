"""`wsi-loader info`: what the index holds, and whether its slides are still there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from wsi_loader import build_index
from wsi_loader.cli import main


def test_info_says_which_slides_are_missing_or_changed(
    archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A deleted slide was listed as ok."""
    out = tmp_path / "idx"
    build_index([archive], out, tile_size=256, level=0, min_tissue=0.0)
    (archive / "bad.svs").unlink()
    good = archive / "good.svs"
    good.write_bytes(good.read_bytes()[:1000])
    assert main(["info", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "2 slides (0 ok, 0 failed, 1 missing, 1 changed)" in shown
    rows = {line.split()[-1]: line.split()[1] for line in shown.splitlines() if ".svs" in line}
    assert rows == {str(archive / "bad.svs"): "missing", str(good): "changed"}
    assert "problem: does not exist" in shown and "changed since indexing" in shown
    assert main(["info", str(out), "--json"]) == 0
    slides = json.loads(capsys.readouterr().out)["slides"]
    assert [s["status"] for s in slides] == ["ok", "ok"]  # as indexed
    assert slides[0]["problem"] == "does not exist"
    assert "changed since indexing" in slides[1]["problem"]


def test_info_shows_the_tiles_mpp_beside_the_scans(
    make_slide: SlideFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The `mpp` column was the scan's (0.25 um/px for tiles read at 0.5 um/px, 20x): the
    tiles' MPP is shown as `tile_mpp`, the scan's as `scan_mpp`."""
    slide = make_slide(width=1024, height=768, seed=9, mpp=0.25)  # a 40x scan
    out = tmp_path / "idx"
    build_index([slide], out, tile_size=64, mag=20, min_tissue=0.0)
    assert main(["info", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["id", "status"])
    row = next(line for line in lines if str(slide) in line)
    cells = dict(zip(header.split(), row.split(), strict=False))
    assert (cells["tile_mpp"], cells["mag"], cells["level"]) == ("0.500", "20x", "0")
    assert cells["scan_mpp"] == "0.250"
