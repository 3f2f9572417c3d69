"""`wsi-loader export`'s options: what a user asks for is done or refused, never silently
ignored (a coords-h5 export reads no pixels and has no units; PNG has no quality; the seed
is --shuffle's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from wsi_loader.cli import main
from wsi_loader.index import SlideIndex, build_index


@pytest.fixture(scope="module")
def index(make_slide: SlideFactory, tmp_path_factory: pytest.TempPathFactory) -> SlideIndex:
    slide = make_slide(width=1024, height=1024, seed=7)
    folder = tmp_path_factory.mktemp("export")
    return build_index([slide], folder / "idx", tile_size=256, level=0, min_tissue=0.0)


def test_the_exports_the_refusals_start_from_succeed(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for n, given in enumerate(
        (["--format", "coords-h5"], ["--format", "webdataset", "--image-format", "jpeg"])
    ):
        code = main(["export", str(index.path), "--out", str(tmp_path / str(n)), *given])
        assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--format", "coords-h5", "--image-format", "jpeg"], ["--image-format", "coords-h5"]),
        (["--format", "coords-h5", "--quality", "50"], ["--quality", "coords-h5"]),
        (["--format", "coords-h5", "--shard-size", "10"], ["--shard-size", "coords-h5"]),
        (["--format", "coords-h5", "--workers", "2"], ["--workers", "coords-h5"]),
        (["--format", "coords-h5", "--verify"], ["--verify", "coords-h5"]),
        (["--format", "coords-h5", "--stain", "reinhard"], ["stain", "coords-h5"]),
        (["--format", "webdataset", "--quality", "50"], ["--quality", "png"]),
        (["--format", "webdataset", "--seed", "3"], ["--seed", "--shuffle"]),
    ],
)
def test_an_option_the_export_would_ignore_is_refused_naming_both(
    given: list[str],
    named: list[str],
    index: SlideIndex,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    code = main(["export", str(index.path), "--out", str(out), "--no-progress", *given])
    err = capsys.readouterr().err
    assert code == 2, err
    assert all(name in err for name in named), err
    assert not out.exists()


def test_workers_with_a_scheduler_are_refused_naming_both(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Dask cluster's workers write the units: --workers was silently ignored."""
    out = tmp_path / "out"
    code = main(["export", str(index.path), "--out", str(out), "--format", "webdataset",
                 "--workers", "4", "--scheduler", "tcp://127.0.0.1:1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--workers" in err and "--scheduler" in err
    assert not out.exists()
