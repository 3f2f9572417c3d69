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
    args = ["index", str(slides), "--out", str(out), "--level", "0", "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err + caplog.text  # the log goes to stderr, as printing does
    said = [i for i in range(broken) if f"broken {i:02d}.svs" in err]
    assert said == list(range(min(broken, 10)))
    assert all(err.count(f"broken {i:02d}.svs") == 1 for i in said)
    assert f"1 ok, {broken} failed" in err
    if broken > 10:
        assert f"and {broken - 10} more slides could not be indexed" in err
        assert f"wsi-loader info {out} --failed" in err
