"""``features`` and ``predict`` through Ray (`RayPass`: read tasks on the cluster's CPUs, the
model in an actor): the files are those of the local pass, and a second run on Ray resumes
(complete slides are kept, not redone)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.feature_models import DiesOnce
from wsi_loader.cli import main
from wsi_loader.features import extract
from wsi_loader.index import SlideIndex
from wsi_loader.models import Model
from wsi_loader.models._pass import _Run
from wsi_loader.predict._run import predict
from wsi_loader.ray import RayPass

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),
]


def h5_contents(folder: Path) -> dict[str, dict[str, object]]:
    """Every dataset and attribute of every h5 file in ``folder``."""
    found: dict[str, dict[str, object]] = {}
    for path in sorted(folder.glob("*.h5")):
        with h5py.File(path, "r") as h5:
            entry: dict[str, object] = {f"@{k}": str(v) for k, v in h5.attrs.items()}
            for name, data in h5.items():
                entry[name] = np.asarray(data[()]).tobytes()
                entry.update({f"{name}@{k}": str(v) for k, v in data.attrs.items()})
            found[path.name] = entry
    return found


def test_features_on_ray_are_the_local_features_and_resume(
    cluster: str, index: SlideIndex, tmp_path: Path
) -> None:
    local = extract(
        index, "tests.feature_models:tiny", tmp_path / "local", batch_size=16, workers=0
    )
    on_ray = extract(
        index, "tests.feature_models:tiny", tmp_path / "ray", batch_size=16, runner=RayPass()
    )
    assert (on_ray.written, on_ray.tiles, on_ray.failed) == (
        local.written,
        local.tiles,
        local.failed,
    )
    assert on_ray.failures == local.failures
    assert h5_contents(tmp_path / "ray") == h5_contents(tmp_path / "local")
    again = extract(
        index, "tests.feature_models:tiny", tmp_path / "ray", batch_size=16, runner=RayPass()
    )
    assert (again.written, again.skipped) == (0, 2)
    # the command line's --ray
    args = ["features", str(index.path), "--out", str(tmp_path / "cli"), "--no-progress"]
    assert (
        main(
            [*args, "--model", "tests.feature_models:tiny", "--batch-size", "16", "--ray", cluster]
        )
        == 0
    )
    assert h5_contents(tmp_path / "cli") == h5_contents(tmp_path / "local")


def test_a_model_worker_killed_mid_run_is_redone_and_nothing_is_written_twice(
    cluster: str, index: SlideIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def model(marker: Path | None) -> Model:
        encoder = DiesOnce(None if marker is None else str(marker))
        mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
        return Model(encoder, "tests.feature_models:tiny", mean=mean, std=std, size=64)

    local = extract(index, model(None), tmp_path / "local", batch_size=16, workers=0)
    finished: list[int] = []
    finish = _Run._finish

    def counted(run: _Run, sid: int, parts: object) -> None:
        finished.append(sid)
        finish(run, sid, parts)  # type: ignore[arg-type]

    monkeypatch.setattr(_Run, "_finish", counted)
    marker = tmp_path / "killed"
    # the model actor's process kills itself on its second batch: Ray starts a new actor and
    # runs the lost batches again
    on_ray = extract(index, model(marker), tmp_path / "ray", batch_size=16, runner=RayPass())
    assert marker.exists(), "the model's process was not killed"
    assert sorted(finished) == [0, 1]  # each slide gathered and written once
    assert (on_ray.written, on_ray.tiles, on_ray.failed) == (
        local.written,
        local.tiles,
        local.failed,
    )
    assert h5_contents(tmp_path / "ray") == h5_contents(tmp_path / "local")


def test_predict_on_ray_writes_the_local_files(
    cluster: str, index: SlideIndex, tmp_path: Path
) -> None:
    model = "tests.feature_models:classifier"
    predict(index, model, tmp_path / "local", batch_size=16, workers=0)
    predict(index, model, tmp_path / "ray", batch_size=16, runner=RayPass())
    local = sorted(
        p.relative_to(tmp_path / "local") for p in (tmp_path / "local").rglob("*") if p.is_file()
    )
    on_ray = sorted(
        p.relative_to(tmp_path / "ray") for p in (tmp_path / "ray").rglob("*") if p.is_file()
    )
    assert local == on_ray
    differ = [
        str(name)
        for name in local
        if (tmp_path / "local" / name).read_bytes() != (tmp_path / "ray" / name).read_bytes()
    ]
    assert differ == []
