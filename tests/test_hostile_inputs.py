"""Hostile and broken inputs get clear errors naming the file, quickly, and lose nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from wsi_loader import ConfigError, IndexFormatError, SlideIndex, build_index, load_config
from wsi_loader.cli import main
from wsi_loader.index import _table_writer as writer_module


@pytest.mark.parametrize("mpp", ["inf", "nan", "1e9", "-1"])
def test_non_finite_or_absurd_numbers_are_refused(
    archive: Path, tmp_path: Path, mpp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "idx"
    assert main(["index", str(archive), "--out", str(out), "--mpp", mpp, "--no-progress"]) == 2
    assert "'mpp'" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ConfigError):
        build_index([archive], out, mpp=float(mpp))


def test_a_yaml_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    config = tmp_path / "bomb.yaml"
    config.write_text("\n".join(lines) + "\nindex:\n  labels: *a8\n")
    with pytest.raises(ConfigError) as caught:  # expanded, 10**9 items: past the suite's limit
        load_config(config)
    assert len(str(caught.value)) < 2000 and str(config) in str(caught.value)


def test_a_binary_config_file_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="not a YAML text file"):
        load_config(config)


def test_a_non_utf8_file_name_fails_only_that_slide(archive: Path, tmp_path: Path) -> None:
    name = os.fsdecode(b"caf\xe9.svs")
    shutil.copy(archive / "good.svs", archive / name)
    index = build_index([archive], tmp_path / "idx", level=0, min_tissue=0.0)
    assert [s.status for s in index.slides] == ["ok"] * 3
    reopened = SlideIndex.open(tmp_path / "idx")
    assert any(s.path.endswith(name) for s in reopened.slides)


@pytest.fixture
def built(archive: Path, tmp_path: Path) -> Path:
    build_index([archive], tmp_path / "idx", level=0, min_tissue=0.0)
    return tmp_path / "idx"


def _generation(out: Path) -> Path:
    return out / (out / "CURRENT").read_text().strip()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda g: (g.parent / "CURRENT").write_bytes(b"\xff\xfe\x00"), "binary data"),
        (lambda g: (g / "l0_x.npy").write_bytes(b""), "unreadable column 'l0_x'"),
        (lambda g: (g / "meta.json").write_text("[]"), "meta.json is not an index"),
        (lambda g: (g / "slides.json").write_text('{"path": 1}'), "slides.json is not a list"),
        (lambda g: (g / "slides.json").write_text("[1, 2]"), "slides.json is not a list"),
    ],
)
def test_damaged_index_files_are_named(built: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    damage(_generation(built))
    with pytest.raises(IndexFormatError, match=message):
        SlideIndex.open(built)


@pytest.mark.parametrize(("column", "value"), [("slide_id", 7), ("slide_id", -1), ("read_size", 0)])
def test_impossible_column_values_are_refused_at_open(built: Path, column: str, value: int) -> None:
    path = _generation(built) / f"{column}.npy"
    array = np.load(path)
    array[3] = value
    np.save(path, array)
    with pytest.raises(IndexFormatError, match=f"column '{column}' holds values"):
        SlideIndex.open(built)


def test_a_full_disk_leaves_the_previous_index(
    built: Path, archive: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    generation = _generation(built).name

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer_module.np, "save", full)
    with pytest.raises(IndexFormatError, match=r"No space left on device.*unchanged"):
        build_index([archive], built, level=0, min_tissue=0.0, tile_size=128)
    monkeypatch.undo()
    assert SlideIndex.open(built).meta["generation"] == generation
    assert not [p for p in built.iterdir() if p.name.startswith(".gen-")]


def test_unreachable_scheduler_and_bad_sizes_exit_2(
    archive: Path, built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["index", str(archive), "--out", str(tmp_path / "x"), "--level", "0", "--no-progress"]
    assert main([*args, "--scheduler", "tcp://127.0.0.1:9"]) == 2
    assert "cannot reach a Dask scheduler at tcp://127.0.0.1:9" in capsys.readouterr().err
    assert main(["inspect", str(built), "--out", str(tmp_path / "i.png"), "--max-size", "0"]) == 2
    assert "--max-size must be at least" in capsys.readouterr().err


def test_the_written_meta_holds_no_infinity(built: Path) -> None:
    text = (_generation(built) / "meta.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in meta.json"))
