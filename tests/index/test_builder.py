from __future__ import annotations

import json
import mmap
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SlideFactory
from wsi_loader.errors import ConfigError, IndexFormatError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index import _builder as builder_module
from wsi_loader.index import _slide_task as slide_task_module
from wsi_loader.index import _table_writer as writer_module
from wsi_loader.index._labels import label_order, similar_labels
from wsi_loader.index._quarantine import Quarantine, coords_in
from wsi_loader.slides import open_slide


@pytest.fixture
def archive(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "archive"
    (folder / "sub").mkdir(parents=True)
    shutil.copy(make_slide(width=3000, height=2400, seed=11), folder / "a.svs")
    shutil.copy(make_slide(width=2600, height=2600, seed=12, mpp=0.25), folder / "sub" / "b.svs")
    shutil.copy(make_slide("tiff", width=2000, height=1500, seed=13), folder / "c.tiff")
    (folder / "notes.txt").write_text("not a slide")
    return folder


def is_file_mapping(array: np.ndarray) -> bool:
    """Whether an array's memory is a file mapping (np.load(mmap_mode="r")), not a copy."""
    base = array
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        base = getattr(base, "base", None)
    return False


def test_builds_columns_and_slide_table(archive: Path, tmp_path: Path) -> None:
    index = build_index([archive], tmp_path / "idx", tile_size=128, mpp=0.5, min_tissue=0.5)
    assert [Path(s.path).name for s in index.slides] == ["a.svs", "c.tiff", "b.svs"]
    assert all(s.status == "ok" and s.tiles > 0 for s in index.slides)
    assert len(index) == sum(s.tiles for s in index.slides)
    for name, column in index.columns.items():
        assert is_file_mapping(column), name
    b = index.slides[2]
    assert (b.mpp, b.read_level, b.read_size, b.tile_mpp) == (0.25, 0, 256, 0.5)
    rows = slice(b.first_row, b.first_row + b.tiles)
    assert set(index.columns["slide_id"][rows].tolist()) == {2}
    assert index.columns["tissue"].min() >= 0.5


def test_tiles_sit_on_tissue(archive: Path, tmp_path: Path) -> None:
    """Tiles the index keeps are mostly stained; the grid cells it drops are mostly glass."""
    index = build_index(
        [archive / "a.svs"], tmp_path / "idx", tile_size=256, mpp=0.5, min_tissue=0.9
    )
    reader = open_slide(index.slide_path(0))
    kept = {
        (int(x), int(y)) for x, y in zip(index.columns["l0_x"], index.columns["l0_y"], strict=True)
    }
    w, h = reader.meta.dimensions
    for x in range(0, w - 255, 256):
        for y in range(0, h - 255, 256):
            pixels = reader.read_region(x, y, 0, 256, 256).astype(np.int16)
            stained = ((pixels.max(-1) - pixels.min(-1)) > 30).mean()
            if (x, y) in kept:
                assert stained > 0.7, (x, y, stained)
            elif stained > 0.99:
                pytest.fail(f"fully stained tile {(x, y)} was dropped")
    reader.close()


def test_level0_is_decoded_only_for_the_stain_sample(
    make_slide: SlideFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All level-0 tiles are corrupt, yet indexing succeeds: tissue and QC read no level 0,
    and the stain sample (storage tiles of the read level, here level 0: the statistics
    tiles are normalised with describe pixels like theirs) fails on its first tile and
    falls back to the mask image."""
    corrupt = [(c, r) for c in range(12) for r in range(8)]
    path = make_slide(width=3072, height=2048, seed=14, corrupt=corrupt)
    levels: list[int] = []
    real_open = slide_task_module.open_slide

    def spying_open(p: str, backend: str = "auto"):  # type: ignore[no-untyped-def]
        reader = real_open(p, backend)
        real_read = reader.read_region

        def read_region(*args: int) -> np.ndarray:
            levels.append(args[2])
            return real_read(*args)

        reader.read_region = read_region  # type: ignore[method-assign]
        return reader

    monkeypatch.setattr(slide_task_module, "open_slide", spying_open)
    index = build_index([path], tmp_path / "idx", tile_size=256, mpp=0.5, min_tissue=0.3)
    assert index.slides[0].status == "ok" and index.slides[0].tiles > 0
    assert levels and levels.count(0) == 1  # the stain sample's first window, no more
    assert (index.slides[0].stain or {}).get("source") in (None, "level 2")  # not level 0's


def test_incremental_skips_unchanged_reindexes_changed(
    archive: Path, tmp_path: Path, make_slide: SlideFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "idx"
    first = build_index([archive], out, tile_size=128)
    calls: list[str] = []
    real = builder_module.index_slide
    monkeypatch.setattr(
        builder_module, "index_slide", lambda task: calls.append(task.stored_path) or real(task)
    )
    second = build_index([archive], out, tile_size=128)
    assert calls == []
    for name in first.columns:
        np.testing.assert_array_equal(first.columns[name], second.columns[name])
    # replace one slide with different content: only that one is re-indexed
    shutil.copy(make_slide(width=1800, height=1800, seed=99), archive / "c.tiff")
    third = build_index([archive], out, tile_size=128)
    assert [Path(c).name for c in calls] == ["c.tiff"]
    assert third.slides[1].width == 1800
    # different grid parameters: everything again
    calls.clear()
    build_index([archive], out, tile_size=256)
    assert len(calls) == 3


def test_killed_build_leaves_previous_index(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "idx"
    before = build_index([archive], out, tile_size=128)
    expected = np.array(before.columns["l0_x"])

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(writer_module.np, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        build_index([archive], out, tile_size=64)
    monkeypatch.undo()
    survivor = SlideIndex.open(out)
    assert survivor.params["tile_size"] == 128
    np.testing.assert_array_equal(survivor.columns["l0_x"], expected)
    del before, survivor  # no process uses generation 1 any more
    rebuilt = build_index([archive], out, tile_size=64)  # leftovers of the killed build are removed
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".lock")) == [
        "CURRENT",
        rebuilt.meta["generation"],
    ]


def test_bad_slides_are_recorded_not_fatal(archive: Path, tmp_path: Path) -> None:
    (archive / "bad.svs").write_text("garbage")
    missing = tmp_path / "gone.svs"
    index = build_index([archive, missing], tmp_path / "idx", workers=2)
    by_name = {Path(s.path).name: s for s in index.slides}
    assert by_name["bad.svs"].status == "failed" and "Unsupported" in (
        by_name["bad.svs"].error or ""
    )
    assert by_name["gone.svs"].error == "slide file does not exist"
    assert by_name["a.svs"].status == "ok"


# Installed in the workers through PYTHONPATH: a slide whose name says so stops answering when
# it is opened, as one on a mount that hangs (the workers are spawned: no monkeypatch reaches
# them).
HANGING_SLIDE_HOOK = """
import time
import wsi_loader.index._slide_task as slide_task

_identify = slide_task.identify

def identify(path, *args, **kwargs):
    if "stuck" in str(path):
        time.sleep(3600)
    return _identify(path, *args, **kwargs)

slide_task.identify = identify
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_a_slide_that_hangs_is_given_up_after_slide_timeout_and_the_rest_indexed(
    archive: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hook_workers: Callable[[str], None],
    workers: int,
) -> None:
    hook_workers(HANGING_SLIDE_HOOK)
    shutil.copy(archive / "a.svs", archive / "stuck scan.1.svs")
    # 30 s: the stuck slide hangs for good, and a good one must not come near it on a busy
    # machine (the test's own limit says the build did not wait for the stuck slide)
    index = build_index([archive], tmp_path / "idx", workers=workers, slide_timeout=30)
    by_name = {Path(s.path).name: s for s in index.slides}
    stuck = by_name.pop("stuck scan.1.svs")
    assert stuck.status == "failed" and stuck.tiles == 0
    assert "not done after 30 s (slide_timeout), so given up" in (stuck.error or "")
    assert {name: s.status for name, s in by_name.items()} == dict.fromkeys(by_name, "ok")
    assert all(s.tiles > 0 for s in by_name.values())
    # the same slides without the time limit: the same tiles for the others
    monkeypatch.delenv("PYTHONPATH")
    (archive / "stuck scan.1.svs").unlink()
    plain = build_index([archive], tmp_path / "plain")
    assert {Path(s.path).name: s.tiles for s in plain.slides} == {
        name: s.tiles for name, s in by_name.items()
    }


# A slide whose name says so kills its worker process when it is opened, as the kernel's
# out-of-memory killer does (SIGKILL), or ends it with an exit status.
DYING_WORKER_HOOK = """
import os, signal
import wsi_loader.index._slide_task as slide_task

_identify = slide_task.identify

def identify(path, *args, **kwargs):
    if "oom" in str(path):
        os.kill(os.getpid(), signal.SIGKILL)
    if "exits" in str(path):
        os._exit(3)
    return _identify(path, *args, **kwargs)

slide_task.identify = identify
"""


def test_a_slide_that_kills_its_worker_is_a_failed_row_and_the_rest_indexed(
    archive: Path, tmp_path: Path, hook_workers: Callable[[str], None]
) -> None:
    """A worker killed while it indexes a slide (out of memory, a crash in a decoder) ended
    the whole build with BrokenProcessPool; now that slide is a failed row with the cause."""
    hook_workers(DYING_WORKER_HOOK)
    shutil.copy(archive / "a.svs", archive / "big oom.svs")
    shutil.copy(archive / "a.svs", archive / "z exits.svs")
    index = build_index([archive], tmp_path / "idx", workers=2)
    by_name = {Path(s.path).name: s for s in index.slides}
    oom, exits = by_name.pop("big oom.svs"), by_name.pop("z exits.svs")
    assert oom.status == exits.status == "failed"
    assert "its worker process died while indexing it (killed by SIGKILL" in (oom.error or "")
    assert "out-of-memory killer" in (oom.error or "")
    assert "(exit status 3)" in (exits.error or "")
    assert {name: s.status for name, s in by_name.items()} == dict.fromkeys(by_name, "ok")
    assert all(s.tiles > 0 for s in by_name.values())


def test_slide_timeout_needs_local_workers(archive: Path, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool, pytest.raises(ConfigError, match="worker processes"):
        build_index([archive], tmp_path / "idx", executor=pool, slide_timeout=5)


def test_parallel_equals_serial(archive: Path, tmp_path: Path) -> None:
    serial = build_index([archive], tmp_path / "s", tile_size=128, workers=1)
    parallel = build_index([archive], tmp_path / "p", tile_size=128, workers=2)
    assert serial.summary()["slides"] == parallel.summary()["slides"]
    for name in serial.columns:
        np.testing.assert_array_equal(serial.columns[name], parallel.columns[name])


def test_root_makes_index_portable(archive: Path, tmp_path: Path) -> None:
    index = build_index([archive], tmp_path / "idx", root=str(archive))
    assert [s.path for s in index.slides] == ["a.svs", "c.tiff", os.path.join("sub", "b.svs")]
    moved = tmp_path / "elsewhere"
    shutil.move(str(archive), moved)
    reopened = SlideIndex.open(tmp_path / "idx", root=str(moved))
    assert reopened.slide_path(2) == str(moved / "sub" / "b.svs")
    assert open_slide(reopened.slide_path(0)).meta.dimensions == (3000, 2400)


def test_root_may_start_with_home(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # '--root=~/slides' reaches us unexpanded: bash expands '~' only at the start of a word
    index = build_index([archive], tmp_path / "idx", root=str(archive))
    monkeypatch.setenv("HOME", str(archive.parent))
    reopened = SlideIndex.open(tmp_path / "idx", root=f"~/{archive.name}")
    assert reopened.slide_path(2) == str(archive / "sub" / "b.svs")
    assert index.view(root="~").slide_path(0) == os.path.join(str(archive.parent), "a.svs")
    assert index.view(root="s3://b/~x").slide_path(0) == "s3://b/~x/a.svs"


def test_a_root_for_an_index_of_absolute_paths_is_refused(archive: Path, tmp_path: Path) -> None:
    """An index built without a root stores absolute paths, which a root cannot remap: it was
    silently ignored (the slides were looked for where they were, and the error then advised
    giving the root that had been given)."""
    index = build_index([archive], tmp_path / "idx")
    assert all(os.path.isabs(s.path) for s in index.slides)
    moved = tmp_path / "elsewhere"
    shutil.move(str(archive), moved)
    for opening in (
        lambda: SlideIndex.open(tmp_path / "idx", root=str(moved)),
        lambda: index.view(root=str(moved)),
    ):
        with pytest.raises(ConfigError, match="absolute") as caught:
            opening()
        assert str(tmp_path / "idx") in str(caught.value) and "--root" in str(caught.value)
    assert SlideIndex.open(tmp_path / "idx").slide_path(0) == index.slide_path(0)
    # an index built with a root its slides are outside of stores their absolute paths too,
    # and is reopened with that root (export's units do): not refused
    elsewhere = build_index([moved], tmp_path / "idx2", root=str(tmp_path / "other"))
    assert all(os.path.isabs(s.path) for s in elsewhere.slides)
    assert len(SlideIndex.open(elsewhere.path, root=elsewhere.root)) == len(elsewhere)


def test_labels_csv_and_manifest(archive: Path, tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\na,tumour\nb,normal\n")
    index = build_index([archive], tmp_path / "idx", labels=str(labels))
    assert [s.label for s in index.slides] == ["tumour", None, "normal"]
    assert index.label_names == ("normal", "tumour")
    assert index.slide_labels().tolist() == [1, -1, 0]
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("path,label,split,mpp\narchive/a.svs,x,train,\narchive/c.tiff,y,val,0.25\n")
    index = build_index([manifest], tmp_path / "idx2", mpp=1.0)
    assert [(s.label, s.split, s.mpp_source) for s in index.slides] == [
        ("x", "train", "vendor"),
        ("y", "val", "manifest"),
    ]
    assert index.slides[1].read_level == 1


def test_numeric_labels_keep_their_numeric_order(archive: Path, tmp_path: Path) -> None:
    # grades or class numbers ('2', '10'): as strings '10' < '2', which gave label '10' id 0
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\na,10\nb,2\nc,0.5\n")
    index = build_index([archive], tmp_path / "idx", labels=str(labels))
    assert index.label_names == ("0.5", "2", "10")
    assert index.slide_labels().tolist() == [2, 0, 1]  # a.svs, c.tiff, sub/b.svs
    assert label_order(["b", "10", "9"]) == ["10", "9", "b"]  # not all numbers: as text
    assert label_order(["1e1", "1", "01"]) == ["01", "1", "1e1"]
    assert label_order(["2", "nan", "10"]) == ["10", "2", "nan"]  # 'nan' is pandas' missing


def _labelled(archive: Path, out: Path, labels: str) -> SlideIndex:
    """The archive indexed with a labels CSV of this text (written next to ``out``)."""
    table = out.with_name(out.name + "-labels.csv")
    table.write_text(labels)
    return build_index([archive], out, labels=str(table))


def test_labels_that_spell_a_missing_value_are_said(
    archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # df["label"].astype(str).to_csv(...) writes a missing label as 'nan', R writes 'NA':
    # each became a class of its own, trained on as if it were a diagnosis
    index = _labelled(archive, tmp_path / "idx", "slide,label\na,tumour\nb,nan\nc,NA\n")
    assert index.label_names == ("NA", "nan", "tumour")  # kept: the user decides
    assert "labels that look like a missing value" in caplog.text
    assert "'NA' (1 slide), 'nan' (1 slide)" in caplog.text
    caplog.clear()
    _labelled(archive, tmp_path / "idx2", "slide,label\na,tumour\nb,normal\nc,Nancy\n")
    assert "missing value" not in caplog.text


def test_labels_that_differ_only_in_case_or_spacing_are_said(
    archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # two spellings of one class are two classes: a typo a model then learns to separate
    index = _labelled(archive, tmp_path / "idx", "slide,label\na,Tumor\nb,tumor\nc,Normal\n")
    assert index.label_names == ("Normal", "Tumor", "tumor")  # kept as written
    assert "labels that differ only in case or spacing: 'Tumor' / 'tumor'" in caplog.text
    caplog.clear()
    assert similar_labels(["High grade", "high_grade", "high-grade", "low", "Low "]) == [
        ["High grade", "high-grade", "high_grade"],
        ["Low ", "low"],
    ]
    assert similar_labels(["1", "2", "a"]) == []


def test_rebuild_excludes_quarantined_tiles(archive: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    index = build_index([archive], out, tile_size=128)
    x, y = int(index.columns["l0_x"][3]), int(index.columns["l0_y"][3])
    path = index.slides[int(index.columns["slide_id"][3])].path
    Quarantine(out / "quarantine.jsonl").append(
        {"slide_id": 0, "path": path, "x": x, "y": y, "error": "boom"}
    )
    assert len(SlideIndex.open(out, exclude_quarantined=True)) == len(index) - 1
    rebuilt = build_index([archive], out, tile_size=128)
    assert len(rebuilt) == len(index) - 1
    assert "1 quarantined tiles excluded" in (rebuilt.slides[0].warning or "")
    kept = build_index([archive], tmp_path / "idx-b", tile_size=128, exclude_quarantined=False)
    assert len(kept) == len(index)


def test_open_rejects_bad_directories(tmp_path: Path, archive: Path) -> None:
    with pytest.raises(IndexFormatError, match="not an index directory"):
        SlideIndex.open(tmp_path)
    out = tmp_path / "idx"
    index = build_index([archive], out)
    meta_file = out / index.meta["generation"] / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["schema_version"] = 999
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(IndexFormatError, match="schema_version 999 is not supported"):
        SlideIndex.open(out)
    meta["schema_version"] = 1
    meta_file.write_text(json.dumps(meta))
    (out / index.meta["generation"] / "l0_x.npy").write_bytes(b"junk")
    with pytest.raises(IndexFormatError, match="unreadable column 'l0_x'"):
        SlideIndex.open(out)


def test_open_names_a_slide_file_given_for_an_index(small_svs: Path) -> None:
    """`wsi-loader info slide.svs` said "cannot read CURRENT: Not a directory"."""
    with pytest.raises(IndexFormatError, match=r"a file, not an index directory.*wsi-loader index"):
        SlideIndex.open(small_svs)


def test_coords_in_matches_exact_pairs() -> None:
    x = np.array([0, 512, 512, -256, 2**31 - 1, 1], dtype=np.int32)
    y = np.array([0, 0, 512, 512, 7, 0], dtype=np.int32)
    level = np.array([0, 0, 1, 1, 2, 0], dtype=np.int16)
    # (1, 2**32) is outside int32: it must not alias the tile (1, 0)
    wanted = {(512, 0, 0), (-256, 512, 1), (2**31 - 1, 7, 2), (0, 512, 0), (1, 2**32, 0)}
    wanted |= {(2**40, 0, 0)}
    assert coords_in(x, y, level, wanted).tolist() == [False, True, False, True, True, False]
    # the level must match too; a record without a level matches every level
    assert not coords_in(x, y, level, {(512, 0, 1), (-256, 512, 0)}).any()
    assert coords_in(x, y, level, {(512, 0, None)}).tolist() == [False, True] + [False] * 4
    assert not coords_in(x, y, level, set()).any()
    assert len(coords_in(x[:0], y[:0], level[:0], wanted)) == 0
