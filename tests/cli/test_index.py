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
