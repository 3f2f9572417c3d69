"""Rebuilds never destroy an index by accident, never race each other, and never mix
generations under a running export."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from wsi_loader import ConfigError, IndexFormatError, InputError, SlideIndex, build_index
from wsi_loader.cli import main
from wsi_loader.export import _running as running_module
from wsi_loader.export import export_index
from wsi_loader.export._unit import ExportUnit


@pytest.fixture
def many(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(6):
        shutil.copy(make_slide(width=1024, height=1024, seed=70 + i), folder / f"s{i}.svs")
    return folder


def test_a_rebuild_that_drops_most_slides_needs_a_flag(many: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    build_index([many], out, level=0, min_tissue=0.0)
    generation = SlideIndex.open(out).meta["generation"]
    for i in range(4):
        (many / f"s{i}.svs").unlink()  # half the share went away
    with pytest.raises(InputError, match=r"would drop 4 of the 6 indexed slides.*allow-shrink"):
        build_index([many], out, level=0, min_tissue=0.0)
    assert SlideIndex.open(out).meta["generation"] == generation
    code = main(["index", str(many), "--out", str(out), "--level", "0", "--no-progress"])
    assert code == 2
    shrunk = build_index([many], out, level=0, min_tissue=0.0, allow_shrink=True)
    assert len(shrunk.slides) == 2


def test_a_second_build_into_the_same_folder_is_refused(many: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    build_index([many], out, level=0, min_tissue=0.0)
    fd = os.open(out / "build.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a running build holds it
    os.pwrite(fd, b"4242\n", 0)
    try:
        with pytest.raises(IndexFormatError, match=r"another build is running.*pid 4242"):
            build_index([many], out, level=0, min_tissue=0.0)
    finally:
        os.close(fd)
    assert build_index([many], out, level=0, min_tissue=0.0).slides


def test_out_that_is_a_file_is_a_clear_error(many: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    out.write_text("not a folder")
    with pytest.raises(IndexFormatError, match="exists and is not a folder"):
        build_index([many], out, level=0)


def test_an_export_reads_its_generation_while_the_index_is_rebuilt(
    many: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "idx"
    index = build_index([many], out, level=0, min_tissue=0.0, tile_size=256)
    real = running_module.export_unit
    rebuilt: list[bool] = []

    def rebuild_after_first(unit: ExportUnit) -> dict:  # type: ignore[type-arg]
        record = real(unit)
        if not rebuilt:  # in place, with another tile size: every row changes meaning
            build_index([many], out, level=0, min_tissue=0.0, tile_size=128)
            rebuilt.append(True)
        return record

    monkeypatch.setattr(running_module, "export_unit", rebuild_after_first)
    report = export_index(index, tmp_path / "export", format="webdataset", shard_size=20)
    assert rebuilt and report.tiles == len(index)
    with open(tmp_path / "export" / "manifest.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(int(r["row"]) for r in rows) == list(range(len(index)))  # none twice, none lost
    assert {int(r["read_size"]) for r in rows} == {256}
    summary = json.loads((tmp_path / "export" / "export.json").read_text())
    assert summary["generation"] == index.meta["generation"]


def test_a_corrupt_settings_file_is_a_clear_error(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "export"
    export_index(index, out, shard_size=50)
    (out / ".export-settings.json").write_bytes(b"")  # a disk-full run left it empty
    with pytest.raises(ConfigError, match=r"settings\.json is unreadable"):
        export_index(index, out, shard_size=50)
