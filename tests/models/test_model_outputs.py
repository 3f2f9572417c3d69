"""Model outputs are checked per batch (issue 36, "bad model outputs are stored as features"):
NaN/Inf fail their slide by name and the others go on; a tuple, integers, another batch size or
a width that changes stop the run with an error naming the model and the slides."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest

from wsi_loader.cli import main
from wsi_loader.errors import ModelOutputError
from wsi_loader.features import extract
from wsi_loader.index import SlideIndex


def test_nan_features_fail_their_slide_by_name_and_the_rest_go_on(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "f"
    report = extract(index, "tests.feature_models:nan_first_slide", out, batch_size=16, workers=0)
    first, second = (s.path for s in index.slides)  # slides are read in index order
    assert [f["slide"] for f in report.failed_slides] == [first]
    assert "NaN or infinite values" in report.failed_slides[0]["reason"]
    assert report.written == 1 and report.written_slides == [second]
    assert not (out / f"{Path(first).stem}.h5").exists()
    with h5py.File(out / f"{Path(second).stem}.h5", "r") as h5:
        assert len(h5["features"]) > 0
    summary = json.loads((out / "features.json").read_text())
    assert [f["slide"] for f in summary["failed_slides"]] == [first]
    # the command says which slide and exits 1; a rerun tries the failed slide again
    code = main(["features", str(index.path), "--model", "tests.feature_models:inf",
                 "--out", str(tmp_path / "g"), "--workers", "0", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    for slide in (first, second):
        assert f"failed: {slide}: the model returned NaN or infinite values for " in err


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("twice_the_rows", r"returned shape \(32, 16\) for a batch of 16 tiles"),
        ("one_row_short", r"returned shape \(15, 16\) for a batch of 16 tiles"),
        ("returns_tuple", "returned a tuple of 2, not a tensor"),
        ("integers", "returned torch.int64 values; outputs must be floating point"),
        ("width_changes", "returned 8 values per tile in this batch, 16 in the first"),
    ],
)
def test_a_model_output_of_the_wrong_shape_is_an_error_naming_model_and_slide(
    index: SlideIndex, tmp_path: Path, model: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"tests.feature_models:{model}"
    with pytest.raises(ModelOutputError, match=message) as caught:
        extract(index, spec, tmp_path / "f", batch_size=16, workers=0)
    assert caught.value.model == spec
    assert caught.value.slides and set(caught.value.slides) <= {s.path for s in index.slides}
    assert not list((tmp_path / "f").glob("*.h5"))
    code = main(["features", str(index.path), "--model", spec, "--out", str(tmp_path / "g"),
                 "--workers", "0", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f"error: model {spec}: " in err and "Traceback" not in err
    assert any(f"(slides of the batch: {s.path}" in err for s in index.slides)
