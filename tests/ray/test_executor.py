"""`RayExecutor` and ``wsi-loader index --ray``: the index built by Ray tasks on a local
cluster is the local build, column for column."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wsi_loader.cli import main
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.ray import RayExecutor

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),
]


def same_index(a: SlideIndex, b: SlideIndex) -> None:
    assert a.summary()["slides"] == b.summary()["slides"]
    assert a.columns.keys() == b.columns.keys()
    for name in a.columns:
        np.testing.assert_array_equal(a.columns[name], b.columns[name])


def test_index_on_ray_is_the_local_index(cluster: str, archive: Path, tmp_path: Path) -> None:
    local = build_index([archive], tmp_path / "local", tile_size=256, level=0, min_tissue=0.2)
    with RayExecutor() as executor:
        on_ray = build_index(
            [archive], tmp_path / "ray", tile_size=256, level=0, min_tissue=0.2, executor=executor
        )
    same_index(local, on_ray)
    flags = ["--tile-size", "256", "--level", "0", "--min-tissue", "0.2", "--no-progress"]
    assert (
        main(["index", str(archive), "--out", str(tmp_path / "cli"), *flags, "--ray", cluster]) == 0
    )
    same_index(local, SlideIndex.open(tmp_path / "cli"))


def test_an_error_in_a_task_comes_back_as_itself(cluster: str) -> None:
    with RayExecutor() as executor:
        future = executor.submit(int, "not a number")
        with pytest.raises(ValueError, match="not a number"):
            future.result()
        assert executor.submit(divmod, 7, 2).result() == (3, 1)


def test_scheduler_and_ray_together_are_refused(
    archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "index",
        str(archive),
        "--out",
        str(tmp_path / "x"),
        "--scheduler",
        "tcp://127.0.0.1:1",
        "--ray",
        "auto",
    ]
    assert main(argv) == 2
    assert "--scheduler (Dask) or --ray" in capsys.readouterr().err


def test_nothing_imports_ray_until_it_is_used() -> None:
    code = (
        "import sys, wsi_loader, wsi_loader.ray, wsi_loader.cli, wsi_loader.dataset\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
        "wsi_loader.ray.RayExecutor\n"
        "assert 'ray' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
