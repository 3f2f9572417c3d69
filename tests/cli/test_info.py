"""`wsi-loader info`: what the index holds, and whether its slides are still there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
