"""`predict` and `features` take slides (files, a folder) instead of an index: the index is
built on the way into --index-out (default OUT/index), reused by a rerun; paths that are
neither an index nor slides, and an --index-out inside another run's output, are refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SlideFactory
from tests.torchrun import torchrun_cli
from wsi_loader.cli import main
from wsi_loader.index import SlideIndex

MODEL = "tests.feature_models:classifier"
ENCODER = "tests.feature_models:tiny"
PASS = ["--workers", "0", "--no-progress", "--device", "cpu"]
GRID = ["--tile-size", "256", "--level", "0", "--min-tissue", "0"]
NAMES = ("case 1.a.svs", "b c.v2.svs")


@pytest.fixture
def slides(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "my slides"
    folder.mkdir()
    for name, seed in zip(NAMES, (41, 42), strict=True):
        shutil.copy(make_slide(width=1024, height=768, seed=seed), folder / name)
    return folder


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a user types it: a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "wsi_loader.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, check=False)


def test_predict_over_a_folder_of_slides_indexes_it_and_a_rerun_reuses_the_index(
    slides: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out put"
    first = cli("predict", str(slides), "--model", MODEL, "--out", str(out), *PASS, *GRID)
    assert first.returncode == 0, first.stderr
    index = SlideIndex.open(out / "index")
    assert sorted(Path(s.path).name for s in index.slides) == sorted(NAMES)
    assert (index.params["tile_size"], index.params["level"]) == (256, 0)  # the options given
    assert all(s.status == "ok" for s in index.slides) and len(index) > 0
    written = sorted(p.name for p in (out / "model-outputs-csv").iterdir())
    assert written == sorted(f"{Path(n).stem}.csv" for n in NAMES)
    rows = sum(len(p.read_text().splitlines()) - 1 for p in (out / "model-outputs-csv").iterdir())
    assert rows == len(index)
    assert f"-> {out / 'index'}" in first.stderr
    stamps = {p: p.stat().st_mtime_ns for p in (out / "model-outputs-csv").iterdir()}
    again = cli("predict", str(slides), "--model", MODEL, "--out", str(out), *PASS, *GRID)
    assert again.returncode == 0, again.stderr
    assert "2 unchanged" in again.stderr and "2 slides already complete" in again.stderr
    assert json.loads((out / "predict.json").read_text())["written"] == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "model-outputs-csv").iterdir()} == stamps


def test_root_with_slides_makes_the_index_built_on_the_way_movable(
    slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--root was not given to the build (absolute paths stored), then the pass opened the
    index with it: ignored, now refused as a root that remaps nothing."""
    out = tmp_path / "p"
    code = run("predict", str(slides), "--root", str(slides), "--model", MODEL, "--out", str(out),
               *GRID)  # fmt: skip
    assert code == 0, capsys.readouterr().err
    index = SlideIndex.open(out / "index")
    assert sorted(s.path for s in index.slides) == sorted(NAMES)  # relative to the root
    moved = tmp_path / "moved"
    shutil.move(str(slides), moved)
    reopened = SlideIndex.open(out / "index", root=str(moved))
    paths = {reopened.slide_path(i) for i in range(len(reopened.slides))}
    assert paths == {str(moved / name) for name in NAMES}


def test_features_over_slide_files_writes_the_index_where_asked(
    slides: Path, tmp_path: Path
) -> None:
    out = tmp_path / "feats"
    where = tmp_path / "the index"
    files = [str(slides / name) for name in NAMES]
    done = cli(
        "features", *files, "--model", ENCODER, "--out", str(out), "--index-out", str(where),
        *PASS, *GRID,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    index = SlideIndex.open(where)
    assert sorted(p.name for p in out.glob("*.h5")) == sorted(f"{Path(n).stem}.h5" for n in NAMES)
    assert not (out / "index").exists() and len(index) > 0


def run(*args: str) -> int:
    return main([*args, *PASS])


@pytest.mark.parametrize("command", ["predict", "features"])
def test_paths_that_are_neither_an_index_nor_slides_are_refused(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty folder"
    empty.mkdir()
    (empty / "notes.txt").write_text("no slide here")
    text = tmp_path / "notes.v1.txt"
    text.write_text("no slide")
    model = MODEL if command == "predict" else ENCODER
    for path, why in (
        (empty, "neither an index (no CURRENT file) nor a folder with slide files"),
        (text, "neither an index nor a slide file (.txt is not a slide format)"),
        (tmp_path / "missing.svs", "no such file or folder"),
    ):
        out = tmp_path / "out"
        assert run(command, str(path), "--model", model, "--out", str(out)) == 2
        err = capsys.readouterr().err
        assert f"error: {path}: {why}" in err, err
        assert not out.exists()


def test_an_index_out_inside_another_runs_output_is_refused(
    slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other run"
    other.mkdir()
    (other / "features.json").write_text("{}")
    inside = other / "sub" / "idx"
    assert run("predict", str(slides), "--model", MODEL, "--out", str(tmp_path / "p"),
               "--index-out", str(inside)) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert f"--index-out {inside} is inside {other}, the output of another run" in err, err
    assert not inside.exists()
    # a predict into the folder of a features run: its default index would be inside it
    assert run("predict", str(slides), "--model", MODEL, "--out", str(other)) == 2
    assert "the output of another run (it holds features.json)" in capsys.readouterr().err
    assert not (other / "index").exists()
    # the output folder itself cannot be the index
    out = tmp_path / "q"
    assert run("predict", str(slides), "--model", MODEL, "--out", str(out),
               "--index-out", str(out)) == 2  # fmt: skip
    assert "is (or holds) the output folder" in capsys.readouterr().err


def test_an_index_with_grid_options_or_beside_slides_is_refused(
    slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wsi_loader.index import build_index

    idx = build_index([slides], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0)
    out = str(tmp_path / "p")
    assert run("predict", str(idx.path), "--model", MODEL, "--out", out, "--mpp", "0.5") == 2
    assert "--mpp go with slides, but" in capsys.readouterr().err
    assert run("predict", str(idx.path), str(slides), "--model", MODEL, "--out", out) == 2
    assert "is an index, given beside other paths" in capsys.readouterr().err
    # (main, not run: PASS's --workers is refused with --mil-model, as the tile pass's)
    assert main(["predict", str(slides), "--mil-model", "m:f", "--out", out, "--level", "0"]) == 2
    assert "with --mil-model, PATH is one features folder" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["predict", "features"])
def test_a_bad_pass_option_is_refused_before_the_slides_are_indexed(
    command: str, slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    model = MODEL if command == "predict" else ENCODER
    target = str(tmp_path / "target.png")
    assert run(command, str(slides), "--model", model, "--out", str(out), "--stain-target", target,
               *GRID) == 2  # fmt: skip
    assert "--stain-target needs --stain macenko" in capsys.readouterr().err
    assert not out.exists()  # nothing indexed on the way


@pytest.mark.slow
def test_under_torchrun_rank_0_indexes_the_slides_and_the_ranks_split_them(
    slides: Path, tmp_path: Path
) -> None:
    """Each rank building into one folder would refuse the other ("another build is running")."""
    out = tmp_path / "ranks"
    done = torchrun_cli(
        tmp_path, "predict", str(slides), "--model", MODEL, "--out", str(out), *PASS, *GRID,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "predict.json").read_text())
    assert summary["ranks"] == 2 and summary["written"] == 2
    assert sorted(summary["written_by"].values()) == [0, 1]
    assert len(SlideIndex.open(out / "index").slides) == 2


@pytest.mark.parametrize("command", ["predict", "features"])
def test_a_folder_without_slides_is_refused_before_torch_is_imported(
    tmp_path: Path, command: str
) -> None:
    """A wrong slide folder is the commonest mistake: its refusal must not wait for torch
    (and the model) to load, which took 6-11 s of a 2-core machine under load."""
    empty = tmp_path / "no slides here"
    empty.mkdir()
    run = (
        "import sys\n"
        "from wsi_loader.cli import main\n"
        f"code = main([{command!r}, {str(empty)!r}, '--model', {MODEL!r}, "
        f"'--out', {str(tmp_path / 'out')!r}, '--no-progress'])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", run], env=env, capture_output=True, text=True, check=False
    )
    assert "no slides here" in done.stderr and "folder with slide files" in done.stderr
    assert done.stdout.split() == ["2", "False"], done.stderr


@pytest.mark.parametrize("command", ["predict", "features"])
def test_a_rerun_with_other_grid_options_is_refused_naming_them(
    command: str, slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One folder, one run: the grid options of the index built on the way are options of
    the run, so a rerun with others (which rebuilt OUT/index and recomputed every output) is
    refused, naming each, with nothing in OUT changed; --overwrite rebuilds it."""
    out = tmp_path / "out"
    model = MODEL if command == "predict" else ENCODER
    assert run(command, str(slides), "--model", model, "--out", str(out), *GRID) == 0
    capsys.readouterr()
    files = sorted(p for p in out.rglob("*") if p.is_file())
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    other = ["--tile-size", "512", "--mpp", "0.5", "--min-tissue", "0"]
    assert run(command, str(slides), "--model", model, "--out", str(out), *other) == 2
    err = capsys.readouterr().err
    index = out / "index"
    assert (
        f"{index} holds an index built with other grid options (--tile-size 256 -> 512; "
        "--mpp none -> 0.5; --level 0 -> none)"
    ) in err, err
    assert "--overwrite" in err
    after = sorted(p for p in out.rglob("*") if p.is_file())
    assert after == files
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in after} == before
    # an index given elsewhere (--index-out) is kept to its options in the same way
    where = tmp_path / "shared index"
    assert run(command, str(slides), "--model", model, "--out", str(tmp_path / "o2"),
               "--index-out", str(where), *GRID) == 0  # fmt: skip
    capsys.readouterr()
    assert run(command, str(slides), "--model", model, "--out", str(tmp_path / "o3"),
               "--index-out", str(where), *GRID[:4], "--min-tissue", "0.3") == 2  # fmt: skip
    assert "--min-tissue 0.0 -> 0.3" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists()
    # with --overwrite the index is rebuilt with the new options
    assert run(command, str(slides), "--model", model, "--out", str(out), *other,
               "--overwrite") == 0  # fmt: skip
    assert SlideIndex.open(index).params["tile_size"] == 512
