"""`features` and `predict` resume by a slide's content: a slide whose tile in the
middle was re-encoded (its size, first and last 64 KiB and mtime kept) is done again after a
rebuild; a slide touched, or copied without its timestamps, is not."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SlideFactory
from tests.index.slide_rewrites import rewrite_keeping_mtime
from wsi_loader.features._extract import extract
from wsi_loader.index import build_index
from wsi_loader.predict._run import predict

MODEL = "tests.feature_models:classifier"
OPTIONS = {"tile_size": 256, "level": 1, "min_tissue": 0.0}


@pytest.fixture
def folder(make_slide: SlideFactory, tmp_path: Path) -> Path:
    """Two slides whose level 1 has its tile arrays and tiles beyond the first and last 64 KiB."""
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copyfile(make_slide(width=4096, height=4096, seed=71), folder / "a.svs")
    shutil.copyfile(make_slide(width=4096, height=4096, seed=77), folder / "b.svs")
    return folder


def _outputs(index_dir: Path, out: Path) -> tuple[list[str], list[str]]:
    """(predict's written slides, features' written slides) of a run on the index."""
    index = build_index([index_dir.parent / "slides"], index_dir, **OPTIONS)
    predicted = predict(index, MODEL, out / "p", workers=0, heatmaps=False)
    features = extract(index, "tests.feature_models:tiny", out / "f", workers=0)
    return predicted.written_slides, features.written_slides


@pytest.mark.parametrize("rewrite", ["reencode", "swap"])
def test_features_and_predict_redo_a_slide_rewritten_in_the_middle(
    folder: Path, tmp_path: Path, rewrite: str
) -> None:
    both = [str(folder / "a.svs"), str(folder / "b.svs")]
    assert _outputs(tmp_path / "idx", tmp_path) == (both, both)
    rewrite_keeping_mtime(folder / "a.svs", rewrite)
    assert _outputs(tmp_path / "idx", tmp_path) == (both[:1], both[:1])


def test_features_and_predict_keep_a_touched_or_copied_slide(folder: Path, tmp_path: Path) -> None:
    _outputs(tmp_path / "idx", tmp_path)
    os.utime(folder / "a.svs", ns=(10**18, 10**18))
    shutil.copyfile(folder / "b.svs", tmp_path / "b.svs")  # cp --preserve=none, then back
    os.replace(tmp_path / "b.svs", folder / "b.svs")
    assert _outputs(tmp_path / "idx", tmp_path) == ([], [])


@pytest.fixture
def small(make_slide: SlideFactory, tmp_path: Path) -> Path:
    folder = tmp_path / "small"
    folder.mkdir()
    for name, seed in (("a.svs", 81), ("b.svs", 82)):
        shutil.copyfile(make_slide(width=1024, height=1024, seed=seed), folder / name)
    return folder


def test_a_rerun_reads_each_slides_stored_outputs_once(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsi_loader.features import _extract as features_module
    from wsi_loader.predict import _run as predict_module

    index = build_index([small], tmp_path / "idx", **OPTIONS)
    predict(index, MODEL, tmp_path / "p", workers=0, heatmaps=False)
    extract(index, "tests.feature_models:tiny", tmp_path / "f", workers=0)
    (tmp_path / "f" / "a.h5").unlink()  # a unfinished, b complete
    next((tmp_path / "p" / "model-outputs-csv").glob("a.*")).unlink()
    reads: list[str] = []

    def counted(read: Any) -> Any:
        def wrapper(path: Path) -> Any:
            reads.append(Path(path).stem)
            return read(path)

        return wrapper

    monkeypatch.setattr(
        features_module, "_stored_content", counted(features_module._stored_content)
    )
    monkeypatch.setattr(predict_module, "read_state", counted(predict_module.read_state))
    assert extract(index, "tests.feature_models:tiny", tmp_path / "f", workers=0).written == 1
    assert sorted(reads) == ["a", "b"]
    reads.clear()
    assert predict(index, MODEL, tmp_path / "p", workers=0, heatmaps=False).written == 1
    assert sorted(reads) == ["a", "b"]


def test_outputs_written_before_slides_were_known_by_content_are_kept(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files whose digest holds the slide's fingerprint (written before slides were known by
    content) are of this very slide version: a rerun keeps them, and redoes one it lacks."""
    from wsi_loader.models import _content as content_module

    index = build_index([small], tmp_path / "idx", **OPTIONS)
    with monkeypatch.context() as old:  # the digests of before
        old.setattr(content_module, "same_slide", lambda record: record.fingerprint)
        assert predict(index, MODEL, tmp_path / "p", workers=0, heatmaps=False).written == 2
        assert extract(index, "tests.feature_models:tiny", tmp_path / "f", workers=0).written == 2
    (tmp_path / "f" / "a.h5").unlink()
    next((tmp_path / "p" / "model-outputs-csv").glob("a.*")).unlink()
    again = predict(index, MODEL, tmp_path / "p", workers=0, heatmaps=False)
    assert (again.written, again.skipped) == (1, 1)
    again = extract(index, "tests.feature_models:tiny", tmp_path / "f", workers=0)
    assert (again.written, again.skipped) == (1, 1)
