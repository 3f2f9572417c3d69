"""`wsi-loader inspect`'s options: what a user asks for is drawn or refused, never silently
ignored (--predictions draws predict's heatmap, not a tile grid coloured by --color-by)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from wsi_loader.cli import main
from wsi_loader.index import build_index


@pytest.fixture(scope="module")
def predicted(make_slide: SlideFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding an index (idx) and predict's outputs over it (p)."""
    folder = tmp_path_factory.mktemp("inspect")
    slide = make_slide(width=1024, height=1024, seed=9)
    build_index([slide], folder / "idx", tile_size=256, level=0, min_tissue=0.0)
    code = main(["predict", str(folder / "idx"), "--model", "tests.feature_models:classifier",
                 "--out", str(folder / "p"), "--workers", "0", "--no-progress"])  # fmt: skip
    assert code == 0
    return folder


def test_color_by_with_predictions_is_refused_naming_both(
    predicted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["inspect", str(predicted / "idx"), "--predictions", str(predicted / "p")]
    assert main([*args, "--out", str(tmp_path / "heatmap.png")]) == 0
    capsys.readouterr()
    out = tmp_path / "qc.png"
    assert main([*args, "--color-by", "qc", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--color-by" in err and "--predictions" in err
    assert not out.exists()
    # without --predictions, --color-by draws as before
    plain = ["inspect", str(predicted / "idx"), "--out", str(tmp_path / "grid.png")]
    assert main([*plain, "--color-by", "status"]) == 0
