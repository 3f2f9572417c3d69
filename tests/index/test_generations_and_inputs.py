"""Generations outlive the processes that read them; inputs found by content; failures loud."""

from __future__ import annotations

import copy
import gc
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from wsi_loader import IndexFormatError, SlideIndex, TileDataset, build_index
from wsi_loader.index._inputs import discover


def test_a_pickled_index_survives_an_in_place_rebuild(archive: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    first = build_index([archive], out, tile_size=256, level=0, min_tissue=0.0)
    blob = pickle.dumps(first)
    dataset_blob = pickle.dumps(TileDataset(first))
    build_index([archive], out, tile_size=128, level=0, min_tissue=0.0)  # in place
    assert (out / first.meta["generation"]).is_dir()  # kept: this process still reads it
    again = pickle.loads(blob)
    np.testing.assert_array_equal(again.columns["l0_x"], first.columns["l0_x"])
    ds = pickle.loads(dataset_blob)
    assert ds[0]["ok"] and ds[0]["image"].shape == (3, 256, 256)
    del first, again, ds
    third = build_index([archive], out, tile_size=64, level=0, min_tissue=0.0)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("gen-")) == [
        third.meta["generation"]
    ]
    with pytest.raises(IndexFormatError, match="open the index again"):
        pickle.loads(blob)


def test_a_generation_in_use_by_another_process_is_kept(archive: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    first = build_index([archive], out, tile_size=256, level=0, min_tissue=0.0)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, wsi_loader as wl; i = wl.SlideIndex.open(sys.argv[1]); "
            "print('open', flush=True); sys.stdin.read()",
            str(out),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        gen = first.meta["generation"]
        del first
        build_index([archive], out, tile_size=128, level=0, min_tissue=0.0)
        assert (out / gen).is_dir()
    finally:
        holder.communicate("")
    build_index([archive], out, tile_size=64, level=0, min_tissue=0.0)
    assert not (out / gen).exists()


def test_a_deep_copy_of_an_index_shares_its_generation_lock(archive: Path, tmp_path: Path) -> None:
    # dataclasses.asdict (Ray Data's metadata export does it to operator arguments) deep-copies
    # whatever holds an index: the copy must not close the descriptor the original holds
    out = tmp_path / "idx"
    first = build_index([archive], out, tile_size=256, level=0, min_tissue=0.0)
    assert first.lock is not None and first.lock.fd is not None
    fd = first.lock.fd
    copies = [copy.deepcopy(first), copy.deepcopy(first.lock), copy.copy(first.lock)]
    assert copies[0].lock is not None and copies[0].lock.fd != fd  # unpickled: its own
    assert copies[1] is first.lock and copies[2] is first.lock
    del copies
    gc.collect()
    os.fstat(fd)  # still open, still the lock's
    assert first.lock.fd == fd
    np.testing.assert_array_equal(copy.copy(first).columns["l0_x"], first.columns["l0_x"])


def test_repr_is_one_short_line(index: SlideIndex) -> None:
    text = repr(index)
    assert "\n" not in text and len(text) < 200 and f"{len(index)} tiles" in text
    assert str(index) == text


def test_dicom_is_found_by_its_preamble(testdata: Path, tmp_path: Path) -> None:
    folder = tmp_path / "archive"
    for name in ("a", "b"):
        series = folder / f"series-{name}"
        series.mkdir(parents=True)
    shutil.copy(testdata / "dicom-boxes" / "boxes_0.dcm", folder / "series-a" / "0.dicom")
    shutil.copy(testdata / "dicom-boxes" / "boxes_1.dcm", folder / "series-a" / "1.dicom")
    shutil.copy(testdata / "dicom-boxes" / "boxes_0.dcm", folder / "series-b" / "IM0001")
    (folder / "series-b" / "notes.txt").write_text("not a slide")
    found = [Path(e.path).relative_to(folder).as_posix() for e in discover([folder])]
    assert found == ["series-a/0.dicom", "series-b/IM0001"]
    index = build_index([folder], tmp_path / "idx", level=0, min_tissue=0.0, tile_size=8)
    assert [s.status for s in index.slides] == ["ok", "ok"]
    assert all(s.vendor == "dicom" for s in index.slides)


def test_symlinked_folders_are_followed_once(archive: Path, tmp_path: Path) -> None:
    top = tmp_path / "top"
    top.mkdir()
    (top / "linked").symlink_to(archive, target_is_directory=True)
    (archive / "loop").symlink_to(top, target_is_directory=True)  # a cycle back up
    found = sorted(Path(e.path).name for e in discover([top]))
    assert found == ["bad.svs", "good.svs"]


def test_failed_slides_are_logged_at_warning(
    archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (archive / "broken.svs").write_text("not a slide")
    with caplog.at_level(logging.WARNING, logger="wsi_loader"):
        build_index([archive], tmp_path / "idx", level=0, min_tissue=0.0)
    assert any(
        r.levelno == logging.WARNING and "broken.svs" in r.getMessage() for r in caplog.records
    )


def test_nothing_to_index_writes_nothing(archive: Path, tmp_path: Path) -> None:
    from wsi_loader import InputError

    out = tmp_path / "idx"
    before = build_index([archive], out, level=0, min_tissue=0.0)
    generation = before.meta["generation"]
    del before
    with pytest.raises(InputError, match="is the share mounted"):
        build_index([tmp_path / "not-mounted"], out, level=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no slide files found"):
        build_index([empty], out, level=0)
    assert SlideIndex.open(out).meta["generation"] == generation


def test_a_manifest_of_missing_slides_names_them(tmp_path: Path) -> None:
    """Every row of a manifest naming a missing file (a name in another Unicode form, a
    wrong folder) said "none of the inputs exists (manifest.csv)": the manifest does."""
    from wsi_loader import InputError

    manifest = tmp_path / "manifest.csv"
    manifest.write_text("path,label\nscan 1.svs,a\nscan 2.svs,b\n")
    with pytest.raises(InputError) as caught:
        build_index([manifest], tmp_path / "idx", level=0)
    message = str(caught.value)
    assert "none of the slides exists" in message, message
    assert f"{tmp_path / 'scan 1.svs'}, {tmp_path / 'scan 2.svs'}" in message, message
    assert f"listed in {manifest}" in message, message
    assert not (tmp_path / "idx").exists()
