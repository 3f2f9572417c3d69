"""`wsi-loader index`: what it prints about the slides it could not index."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from wsi_loader.cli import main


@pytest.mark.parametrize("broken", [3, 14])
def test_each_failed_slide_is_said_once(
    tmp_path: Path,
    make_slide: SlideFactory,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    broken: int,
) -> None:
    """Every failure was printed twice: its WARNING during the build, then again in the
    summary. Up to 10 are said one by one, the rest counted, with where to list them all."""
    slides = tmp_path / "slides"
    slides.mkdir()
    (slides / "ok.svs").write_bytes(make_slide(width=600, height=500, seed=4).read_bytes())
    for i in range(broken):
        (slides / f"broken {i:02d}.svs").write_text("not a slide")
    out = tmp_path / "idx"
    args = ["index", str(slides), "--out", str(out), "--level", "0", "--tile-size", "64"]
    assert main([*args, "--no-progress"]) == 0
    err = capsys.readouterr().err + caplog.text  # the log goes to stderr, as printing does
    said = [i for i in range(broken) if f"broken {i:02d}.svs" in err]
    assert said == list(range(min(broken, 10)))
    assert all(err.count(f"broken {i:02d}.svs") == 1 for i in said)
    assert f"1 ok, {broken} failed" in err
    if broken > 10:
        assert f"and {broken - 10} more slides could not be indexed" in err
        assert f"wsi-loader info {out} --failed" in err


def test_mag_indexes_by_magnification_and_records_both(
    tmp_path: Path,
    make_slide: SlideFactory,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--mag 20` on a 40x scan (0.25 um/px, AppMag 40, downsamples 1/4/16) reads level 0
    shrunk by 2; on a scan whose manifest MPP says otherwise than its objective (a "40x" at
    0.5 um/px), the disagreement is reported as other resolution notes are."""
    import json

    from wsi_loader.index import SlideIndex

    slides = tmp_path / "slides"
    slides.mkdir()
    for name, seed in (("forty", 8), ("mislabelled", 9)):
        scan = make_slide(width=2048, height=1536, seed=seed, mpp=0.25)
        (slides / f"{name}.svs").write_bytes(scan.read_bytes())
    manifest = slides / "manifest.csv"
    manifest.write_text("path,label,mpp\nforty.svs,a,\nmislabelled.svs,b,0.5\n")
    out = tmp_path / "idx"
    args = ["index", str(manifest), "--out", str(out), "--mag", "20", "--tile-size", "128"]
    assert main([*args, "--min-tissue", "0", "--no-progress"]) == 0
    index = SlideIndex.open(out)
    assert index.params["mag"] == 20 and index.params["mpp"] is None
    forty, mislabelled = sorted(index.slides, key=lambda s: s.path)
    assert (forty.read_level, forty.read_size, forty.tile_mag, forty.tile_mpp) == (0, 256, 20, 0.5)
    assert forty.mag_source == "objective-power" and forty.warning is None
    # the objective power decides: 20x of a "40x" is a downsample of 2 whatever its MPP
    assert (mislabelled.read_level, mislabelled.read_size, mislabelled.tile_mpp) == (0, 256, 1.0)
    note = "states 40x but its MPP 0.5 um/px is 20x by 10 / mpp"
    assert note in (mislabelled.warning or "")
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    listed = {Path(s["path"]).stem: s for s in json.loads(capsys.readouterr().out)["slides"]}
    assert listed["mislabelled"]["tile_mag"] == 20 and note in listed["mislabelled"]["warning"]
    assert listed["forty"]["mag_source"] == "objective-power"
    assert note in caplog.text  # said while indexing, with the slide's other notes
    # one of --mpp, --mag and --level
    with pytest.raises(SystemExit):
        main([*args, "--mpp", "0.5"])


def test_mag_from_a_config_file(tmp_path: Path, make_slide: SlideFactory) -> None:
    from wsi_loader.index import SlideIndex

    config = tmp_path / "c.yaml"
    config.write_text("index:\n  mag: 10\n  tile_size: 64\n  min_tissue: 0\n")
    slide = make_slide(width=1024, height=768, seed=9, mpp=0.5)  # AppMag 20
    out = tmp_path / "idx"
    assert main(["index", str(slide), "--out", str(out), "--config", str(config)]) == 0
    record = SlideIndex.open(out).slides[0]
    assert (record.read_level, record.read_size, record.tile_mag) == (0, 128, 10)


def test_an_index_without_a_tile_is_an_error(
    tmp_path: Path,
    make_slide: SlideFactory,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A folder whose every input fails or gives no tile exited 0 with '0 tiles', where one
    failed input exited 1: both are 'error: no tile could be indexed', exit 1."""
    slides = tmp_path / "slides"
    slides.mkdir()
    (slides / "tiny.svs").write_bytes(make_slide(width=120, height=100, seed=4).read_bytes())
    (slides / "broken.svs").write_text("not a slide")
    out = tmp_path / "idx"
    args = ["index", str(slides), "--out", str(out), "--level", "0", "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err + caplog.text
    assert "1 ok, 1 failed" in err and "0 tiles" in err
    assert (
        "error: no tile could be indexed (1 slide failed, 1 slide has no tile; each "
        "slide's reason is in the warnings above)"
    ) in err
    assert err.count("broken.svs") == 1 and err.count("tiny.svs") == 1  # said once each
    assert main(["index", str(slides / "broken.svs"), "--out", str(tmp_path / "j")]) == 1
    assert "error: no slide could be indexed" in capsys.readouterr().err


@pytest.mark.parametrize("written", ["20x", "20X", " 20 x"])
def test_mag_is_accepted_as_pathologists_write_it(
    tmp_path: Path, make_slide: SlideFactory, written: str
) -> None:
    """`--mag 20x` was refused by argparse ("invalid float value"): it works as `--mag 20`,
    on the command line and in a config file."""
    from wsi_loader.index import SlideIndex

    slide = make_slide(width=1024, height=768, seed=9, mpp=0.25)  # AppMag 40
    out = tmp_path / "idx"
    args = ["index", str(slide), "--out", str(out), "--tile-size", "64", "--min-tissue", "0"]
    assert main([*args, "--mag", written, "--no-progress"]) == 0
    record = SlideIndex.open(out).slides[0]
    assert (record.read_level, record.read_size, record.tile_mag) == (0, 128, 20)
    assert SlideIndex.open(out).params["mag"] == 20
    config = tmp_path / "c.yaml"
    config.write_text(f"index:\n  mag: '{written}'\n  tile_size: 64\n  min_tissue: 0\n")
    out2 = tmp_path / "idx2"
    assert main(["index", str(slide), "--out", str(out2), "--config", str(config)]) == 0
    assert SlideIndex.open(out2).slides[0].tile_mag == 20


@pytest.mark.parametrize("written", ["20y", "x", "twenty", "20xx", "-20x"])
def test_a_magnification_that_is_not_one_is_refused(
    tmp_path: Path, make_slide: SlideFactory, capsys: pytest.CaptureFixture[str], written: str
) -> None:
    slide = make_slide(width=300, height=200, seed=9)
    with pytest.raises(SystemExit) as exited:
        main(["index", str(slide), "--out", str(tmp_path / "i"), f"--mag={written}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--mag" in err and "20x" in err  # says how to write one
    config = tmp_path / "c.yaml"
    config.write_text(f"index:\n  mag: '{written}'\n")
    assert main(["index", str(slide), "--out", str(tmp_path / "j"), "--config", str(config)]) == 2
    assert "'index.mag'" in capsys.readouterr().err


@pytest.mark.parametrize("cluster", [["--scheduler", "tcp://127.0.0.1:1"], ["--ray", "auto"]])
def test_workers_with_a_cluster_are_refused_naming_both(
    cluster: list[str], tmp_path: Path, make_slide: SlideFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cluster's workers index the slides: --workers was silently ignored (Dask, Ray)."""
    slide = make_slide(width=1024, height=768, seed=3)
    out = tmp_path / "idx"
    code = main(["index", str(slide), "--out", str(out), "--workers", "4", *cluster])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--workers" in err and cluster[0] in err
    assert not out.exists()
