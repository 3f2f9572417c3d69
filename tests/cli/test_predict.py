"""`wsi-loader predict`'s options: what a user asks for is done or refused, never silently
ignored (a MIL model reads a features folder: the tile pass's options mean nothing to it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from wsi_loader.cli import main
from wsi_loader.features import extract
from wsi_loader.index import build_index

MODEL = "tests.feature_models:classifier"
MIL = ["--mil-model", "tests.feature_models:bag_model", "--device", "cpu"]


@pytest.fixture(scope="module")
def features(make_slide: SlideFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A features folder a MIL model runs over (its run with no other option succeeds)."""
    folder = tmp_path_factory.mktemp("features")
    slide = make_slide(width=1024, height=1024, seed=5)
    index = build_index([slide], folder / "idx", tile_size=256, level=0, min_tissue=0.0)
    extract(index, "tests.feature_models:tiny", folder / "features", workers=0)
    return folder / "features"


def test_the_runs_the_refusals_start_from_succeed(
    features: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["predict", str(features), *MIL, "--out", str(tmp_path / "mil")])
    assert code == 0, capsys.readouterr().err
    code = main(["predict", str(features.parent / "idx"), "--model", MODEL, "--out",
                 str(tmp_path / "p"), "--workers", "0", "--no-heatmaps"])  # fmt: skip
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--ray", "auto"], "--ray"),
        (["--tta", "d4"], "--tta"),
        (["--workers", "2"], "--workers"),
        (["--timeout", "5"], "--timeout"),
        (["--dtype", "float16"], "--dtype"),
        (["--batch-size", "8"], "--batch-size"),
        (["--slide-rule", "max"], "--slide-rule"),
        (["--top-k", "3"], "--top-k"),
        (["--missing-slides", "exclude"], "--missing-slides"),
        (["--quarantine", "q.jsonl"], "--quarantine"),
        (["--root", "/elsewhere"], "--root"),
    ],
)
def test_a_tile_pass_option_with_a_mil_model_is_refused_naming_both(
    given: list[str],
    named: str,
    features: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "mil"
    code = main(["predict", str(features), *MIL, "--out", str(out), *given])
    err = capsys.readouterr().err
    assert code == 2, err
    assert named in err and "--mil-model" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "given", [["--heatmap-class", "tumour"], ["--heatmap-size", "2048"]], ids=["class", "size"]
)
def test_a_heatmap_option_with_no_heatmaps_is_refused_naming_both(
    given: list[str], features: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    code = main(["predict", str(features.parent / "idx"), "--model", MODEL, "--out", str(out),
                 "--workers", "0", "--no-progress", "--no-heatmaps", *given])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert given[0] in err and "--no-heatmaps" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--threshold", "1.5"], "argument --threshold: must be in [0, 1], got 1.5"),
        (["--top-k", "0"], "argument --top-k: must be a whole number >= 1, got 0"),
        (["--heatmap-size", "10"], "argument --heatmap-size: must be 64 to 8192 pixels, got 10"),
    ],
)
def test_an_option_out_of_range_is_named_as_typed(
    given: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--threshold 1.5` said "threshold must be in [0, 1]", the library's keyword for it."""
    out = tmp_path / "p"
    with pytest.raises(SystemExit) as exited:
        main(["predict", str(tmp_path), "--model", MODEL, "--out", str(out), *given])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert not out.exists()
