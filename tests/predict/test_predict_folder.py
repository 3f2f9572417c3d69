"""A `predict` or `features` output folder holds one run's outputs: a run with other options
is refused (the folder unchanged) unless --overwrite, a folder another run is writing is
refused; a slide is the same slide by its content (a touch redoes nothing, new bytes redo
it); a rerun with nothing to do keeps slides.csv and metrics.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from wsi_loader.cli import main
from wsi_loader.errors import ConfigError
from wsi_loader.features._extract import extract
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.predict._run import predict

MODEL = "tests.feature_models:classifier"


def snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``folder``: inode, mtime and bytes."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            st = path.stat()
            files[str(path.relative_to(folder))] = (st.st_ino, st.st_mtime_ns, path.read_bytes())
    return files


def run_predict(index: SlideIndex, out: Path, *options: str) -> int:
    return main(["predict", str(index.path), "--model", MODEL, "--out", str(out), "--workers",
                 "0", "--no-progress", "--no-heatmaps", *options])  # fmt: skip


def test_a_second_predict_with_other_options_is_refused_and_changes_nothing(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both runs exited 0 and left softmax CSVs beside sigmoid ones, predict.json the
    second's."""
    out = tmp_path / "p"
    assert run_predict(index, out) == 0
    before = snapshot(out)
    capsys.readouterr()
    for other in (["--multi-label"], ["--tta", "flips"], ["--slide-rule", "max"]):
        assert run_predict(index, out, *other) == 2
        err = capsys.readouterr().err
        assert "other options" in err and "--overwrite" in err, err
        assert snapshot(out) == before
    assert run_predict(index, out) == 0  # the same options: a rerun
    assert run_predict(index, out, "--multi-label", "--overwrite") == 0
    run = json.loads((out / "predict.json").read_text())
    assert run["activation"] == "sigmoid" and run["written"] == 2
    assert run_predict(index, out, "--multi-label") == 0


def test_the_refusal_shows_what_changed(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun with --threshold 0.7 was refused for "slide_rule differ", an option it did not
    pass: the values there and now show that the threshold is what changed."""
    out = tmp_path / "p"
    assert run_predict(index, out) == 0
    capsys.readouterr()
    assert run_predict(index, out, "--threshold", "0.7") == 2
    err = capsys.readouterr().err
    assert 'slide_rule: ["mean", 10, 0.5] -> ["mean", 10, 0.7]' in err, err


def test_overwrite_removes_the_slides_the_new_run_does_not_write(
    archive: Path, tmp_path: Path
) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label,split\ngood,normal,test\nbad,tumour,train\n")
    index = build_index([archive], tmp_path / "idx", tile_size=256, level=0, labels=str(labels))
    out = tmp_path / "p"
    predict(index, MODEL, out, workers=0, heatmaps=False, split="train")
    assert sorted(p.name for p in (out / "model-outputs-csv").iterdir()) == ["bad.csv"]
    with pytest.raises(ConfigError, match="other options"):
        predict(index, MODEL, out, workers=0, heatmaps=False, split="test", tta="flips")
    predict(index, MODEL, out, workers=0, heatmaps=False, split="test", tta="flips",
            overwrite=True)  # fmt: skip
    assert sorted(p.name for p in (out / "model-outputs-csv").iterdir()) == ["good.csv"]
    assert sorted(p.name for p in (out / "model-outputs-geojson").iterdir()) == ["good.json"]


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("command", ["predict", "features"])
def test_a_folder_another_run_is_writing_is_refused(
    index: SlideIndex, tmp_path: Path, command: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    model = "tests.feature_models:tiny" if command == "features" else MODEL
    run = predict if command == "predict" else extract
    # another process holds the folder's lock, as a running predict or features does
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out / ".wsi-loader.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match="another run is writing"):
            run(index, model, out, workers=0)
        assert sorted(p.name for p in out.iterdir()) == [".wsi-loader.lock"]
    finally:
        holder.communicate("")  # it lets go
    run(index, model, out, workers=0)


def test_features_with_another_model_into_the_same_folder_are_refused(
    index: SlideIndex, tmp_path: Path
) -> None:
    out = tmp_path / "f"
    extract(index, "tests.feature_models:tiny", out, workers=0)
    before = snapshot(out)
    with pytest.raises(ConfigError, match="model"):
        extract(index, "tests.feature_models:plain", out, workers=0)
    assert snapshot(out) == before
    report = extract(index, "tests.feature_models:plain", out, workers=0, overwrite=True)
    assert report.written == 2


def test_a_touched_slide_is_the_same_slide_and_new_bytes_are_not(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    """After touch and a re-index, export resumed but features and predict redid the slide:
    an archive copied without its timestamps would recompute every feature."""
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(make_slide(width=1024, height=1024, seed=41), folder / "a.svs")
    shutil.copy(make_slide(width=1024, height=1024, seed=42), folder / "b.svs")
    options = {"tile_size": 256, "level": 0, "min_tissue": 0.0}
    index = build_index([folder], tmp_path / "idx", **options)
    predict(index, MODEL, tmp_path / "p", workers=0, heatmaps=False)
    extract(index, "tests.feature_models:tiny", tmp_path / "f", workers=0)
    os.utime(folder / "a.svs", ns=(10**18, 10**18))  # touched: another mtime, same bytes
    shutil.copy(make_slide(width=1024, height=1024, seed=43), folder / "b.svs")  # new bytes
    index = build_index([folder], tmp_path / "idx", **options)
    assert index.slides[0].mtime_ns == 10**18
    report = predict(index, MODEL, tmp_path / "p", workers=0, heatmaps=False)
    assert (report.skipped, report.written_slides) == (1, [str(folder / "b.svs")])
    features = extract(index, "tests.feature_models:tiny", tmp_path / "f", workers=0)
    assert (features.skipped, features.written_slides) == (1, [str(folder / "b.svs")])


def test_a_rerun_with_nothing_to_do_keeps_slides_csv_and_metrics(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    assert run_predict(index, out) == 0
    first = capsys.readouterr().err
    kept = {name: (out / name).stat() for name in ("slides.csv", "metrics.json")}
    assert run_predict(index, out) == 0
    again = capsys.readouterr().err
    for name, st in kept.items():  # not written again (a rewrite renames a new file over it)
        assert (out / name).stat().st_ino == st.st_ino, name
    # the same slide results and metrics are printed, read back
    assert first.split("\n", 1)[1] == again.split("\n", 1)[1]
    assert json.loads((out / "predict.json").read_text())["skipped"] == 2
    (out / "model-outputs-csv" / "good.csv").unlink()  # good is done again: a new summary
    assert run_predict(index, out) == 0
    assert (out / "slides.csv").stat().st_ino != kept["slides.csv"].st_ino
