from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SlideFactory
from wsi_loader.cli import main


@pytest.fixture
def slides(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "slides"
    folder.mkdir()
    for seed in (21, 22):
        (folder / f"s{seed}.svs").write_bytes(
            make_slide(width=2000, height=1600, seed=seed).read_bytes()
        )
    (folder / "bad.svs").write_text("garbage")
    return folder


def test_index_then_info_json(
    slides: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = tmp_path / "idx"
    assert (
        main(
            [
                "index",
                str(slides),
                "--out",
                str(out),
                "--tile-size",
                "128",
                "--mpp",
                "0.5",
                "--min-tissue",
                "0.4",
                "--stride",
                "64",
                "--workers",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "3 slides (2 ok, 1 failed; 3 indexed)" in err and "bad.svs" in caplog.text
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["schema_version"] == 1 and info["quarantined"] == []
    assert info["tiles"] == sum(s["tiles"] for s in info["slides"]) > 0
    assert [s["status"] for s in info["slides"]] == ["failed", "ok", "ok"]
    first = info["slides"][0]
    assert {"path", "status", "error", "tiles", "mpp", "label"} <= first.keys()
    assert first["error"] and info["slides"][1]["error"] is None
    assert info["params"]["stride"] == 64
    assert main(["info", str(out)]) == 0
    assert "3 slides (2 ok, 1 failed)" in capsys.readouterr().out


def test_config_file_and_flag_override(
    slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("index:\n  tile_size: 64\n  mpp: null\n  level: 1\n")
    out = tmp_path / "idx"
    assert (
        main(
            ["index", str(slides), "--out", str(out), "--config", str(config), "--tile-size", "32"]
        )
        == 0
    )
    main(["info", str(out), "--json"])
    params = json.loads(capsys.readouterr().out)["params"]
    assert (params["tile_size"], params["level"], params["mpp"]) == (32, 1, None)


def test_exit_codes(slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["index", str(slides / "bad.svs"), "--out", str(tmp_path / "i")]) == 1
    assert "no slide could be indexed" in capsys.readouterr().err
    bad = tmp_path / "c.yaml"
    bad.write_text("index:\n  colour: red\n")
    assert main(["index", str(slides), "--out", str(tmp_path / "j"), "--config", str(bad)]) == 2
    assert f"error: {bad}: unknown key 'index.colour'" in capsys.readouterr().err
    assert main(["info", str(tmp_path)]) == 2
    with pytest.raises(SystemExit) as info:
        main(["index", str(slides), "--out", "x", "--mpp", "0.5", "--level", "1"])
    assert info.value.code == 2


def test_console_script_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "wsi_loader.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "index" in result.stdout and "info" in result.stdout


def test_bench_json_on_an_index_with_bad_tiles(index, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert (
        main(
            [
                "bench",
                str(index.path),
                "--tiles",
                "40",
                "--batch-size",
                "8",
                "--workers",
                "1",
                "--device",
                "cpu",
                "--step-ms",
                "1",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    names = [(r["name"], r["workers"]) for r in result["results"]]
    assert names == [
        ("openslide", 0),
        ("openslide-naive", 0),
        ("wsi_loader", 0),
        ("make_loader", 0),
        ("make_loader", 1),
    ]
    baseline = result["results"][0]["tiles_per_s"]
    for r in result["results"]:  # every ratio is against the same measured baseline
        assert r["tiles_per_s"] > 0
        assert r["vs_openslide"] == pytest.approx(r["tiles_per_s"] / baseline, rel=0.01, abs=0.01)
    assert 0 <= result["device"]["waiting_share"] <= 1
    assert result["device"]["decode"] == "cpu" and result["device_decode"]["decode"] == "device"
    assert result["device_decode"]["tiles_per_s"] > 0
    assert main(["bench", str(index.path), "--tiles", "0"]) == 2
    # a simulated model step needs a device to feed; a negative one is a typo
    assert main(["bench", str(index.path), "--step-ms", "20"]) == 2
    assert "--step-ms is the model step of --device" in capsys.readouterr().err
    assert main(["bench", str(index.path), "--device", "cpu", "--step-ms", "-1"]) == 2


def test_demo_needs_at_least_one_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--out", str(tmp_path / "d"), "--batches", "0"]) == 2
    assert "--batches must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # checked before any slide is written


def test_version_names_the_libraries_a_bug_report_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import re

    import openslide

    import wsi_loader

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    pyproject = (REPO / "pyproject.toml").read_text()
    declared = re.search(r'^version = "(.*)"$', pyproject, re.MULTILINE)
    assert declared is not None and declared[1] == wsi_loader.__version__
    assert out.startswith(f"wsi-loader {wsi_loader.__version__} ")
    assert f"OpenSlide {openslide.__library_version__}" in out
    for name in ("openslide-python", "tifffile", "torch", "numpy", "Python"):
        assert f"{name} " in out


def test_index_says_what_a_rerun_reused(
    slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["index", str(slides), "--out", str(tmp_path / "i"), "--level", "0", "--no-progress"]
    assert main(args) == 0
    assert "3 slides (2 ok, 1 failed; 3 indexed), " in capsys.readouterr().err
    assert main(args) == 0
    # the failed slide is tried again (it may have been fixed); the others are reused
    assert "3 slides (2 ok, 1 failed; 2 unchanged, 1 indexed), " in capsys.readouterr().err
    assert main(["info", str(tmp_path / "i"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["build"] == {"unchanged": 2, "indexed": 1}


def test_info_names_the_label_ids(index, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    # what a training script's targets mean: ids are positions in the label names
    assert main(["info", str(index.path)]) == 0
    names = ", ".join(f"{i} = {n}" for i, n in enumerate(index.label_names))
    assert f"label ids: {names}" in capsys.readouterr().out


def test_many_failed_slides_are_summed_up_and_info_lists_them(
    slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # an archive of 10,000 slides with 3% unreadable printed 300 'failed:' lines after the
    # 300 warnings of the run; the full list is for `info --failed`
    for i in range(14):
        (slides / f"broken {i:02d}.svs").write_text("not a slide")
    out = tmp_path / "idx"
    assert main(["index", str(slides), "--out", str(out), "--tile-size", "128", "--mpp", "0.5",
                 "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()  # what the build says of them: tests/cli/test_index.py
    assert main(["info", str(out), "--failed"]) == 0
    shown = capsys.readouterr().out
    assert "17 slides (2 ok, 15 failed)" in shown  # the totals stay those of the index
    assert shown.count(" failed ") == 15 and " ok " not in shown and "s21.svs" not in shown
    assert main(["info", str(out), "--failed", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["slides"]) == 15 and {s["status"] for s in summary["slides"]} == {"failed"}


def test_names_with_terminal_control_codes_are_printed_escaped(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """Slide names and labels are untrusted: a name holding an escape sequence (here: clear
    the screen) or a newline must not reach the terminal as such from index, info or the
    log; it is printed escaped, and the index keeps the real name."""
    import shutil

    folder = tmp_path / "slides"
    folder.mkdir()
    evil = "scan \x1b[2J\x1b]0;owned\x07.svs"
    shutil.copy(make_slide(width=600, height=500, seed=4), folder / evil)
    (folder / "broken\nline.svs").write_text("not a slide")
    labels = tmp_path / "labels.csv"
    labels.write_text(f'slide,label\n"{evil[:-4]}",tumour\x1b[31m\n')
    notes = tmp_path / "notes"  # an annotation class named with a colour code
    notes.mkdir()
    pen = {
        "type": "Feature",
        "geometry": {"type": "Polygon", "coordinates": [[[0, 0], [300, 0], [300, 300], [0, 0]]]},
        "properties": {"classification": {"name": "pen\x1b[31m"}},
    }
    (notes / f"{evil[:-4]}.geojson").write_text(json.dumps([pen]))
    out = tmp_path / "idx"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "wsi_loader.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, check=False)

    built = cli(
        "index", str(folder), "--out", str(out), "--level", "0", "--min-tissue", "0",
        "--labels", str(labels), "--annotations", str(notes),
    )  # fmt: skip
    shown = cli("info", str(out))
    drawn = cli("inspect", str(out), "--out", str(tmp_path / "overview.png"))
    assert built.returncode == 0, built.stderr
    assert drawn.returncode == 0, drawn.stderr
    for text in (built.stdout, built.stderr, shown.stdout, shown.stderr, drawn.stderr):
        assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b[2J" in shown.stdout and "tumour\\x1b[31m" in shown.stdout
    assert "broken\\nline.svs" in shown.stdout and "broken\\nline.svs" in built.stderr
    assert "annotation classes: pen\\x1b[31m (1 slides" in built.stderr
    # the log too: a newline in a name would start a forged log line
    assert "cannot index" in built.stderr and "broken\nline" not in built.stderr
    from wsi_loader.index import SlideIndex

    assert {Path(s.path).name for s in SlideIndex.open(out).slides} == {
        evil,
        "broken\nline.svs",
    }
