"""A disk that fills up (or a quota, or a file size limit) while a command writes.

Every command ends with one line naming the file and the reason, not a traceback; nothing is
left under a final name half-written, no temporary file keeps the space, and finished work
is kept so that the same command, run again with room, completes.

The commands run in a child process whose file size limit (RLIMIT_FSIZE) stands in for the
full disk: a write past it fails with EFBIG as a write to a full disk fails with ENOSPC, and
that needs no privileges (Python ignores the SIGXFSZ that would otherwise end the process).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from wsi_loader.files import replacing
from wsi_loader.index import SlideIndex, build_index


def run_limited(limit: int | None, *args: str) -> subprocess.CompletedProcess[str]:
    def limit_file_size() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "wsi_loader.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
    )


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp" in p.name)


def said_once(done: subprocess.CompletedProcess[str], path_part: str) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, done.stderr
    assert "File too large" in lines[0] and path_part in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def index(tmp_path: Path, make_slide: SlideFactory) -> SlideIndex:
    folder = tmp_path / "slides"
    folder.mkdir()
    (folder / "a.b c.svs").write_bytes(make_slide(width=2048, height=1536, seed=5).read_bytes())
    labels = tmp_path / "labels.csv"  # (image-folder exports hold labelled tiles only)
    labels.write_text("slide,label\na.b c,tissue\n")
    return build_index(
        [folder], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0, labels=str(labels)
    )


def test_replacing_removes_the_temporary_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"), replacing(target) as tmp:
        tmp.write_bytes(b"half")
        raise OSError(28, "disk full")
    assert target.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [target]
    folder = tmp_path / "gen"
    with replacing(folder) as tmp:
        tmp.mkdir()  # a folder too (an index generation)
        (tmp / "x").write_text("x")
    assert (folder / "x").read_text() == "x"
    with pytest.raises(KeyboardInterrupt), replacing(tmp_path / "d") as tmp:
        tmp.mkdir()
        (tmp / "x").write_text("x")
        raise KeyboardInterrupt
    assert sorted(tmp_path.iterdir()) == [folder, target]


def test_index_build_on_a_full_disk_keeps_the_old_generation(
    index: SlideIndex, tmp_path: Path
) -> None:
    before = index.meta["generation"]
    slides = str(tmp_path / "slides")
    # the rebuild must write anew (another tile size); its meta.json is over 500 bytes
    done = run_limited(
        500, "index", slides, "--out", str(index.path), "--level", "0", "--tile-size", "128",
        "--min-tissue", "0", "--no-progress",
    )  # fmt: skip
    said_once(done, str(index.path))
    assert "run the same command again" in done.stderr
    assert SlideIndex.open(index.path).meta["generation"] == before
    assert leftovers(index.path) == []


@pytest.mark.parametrize("workers", ["1", "2"])
def test_export_on_a_full_disk_leaves_no_partial_file_and_resumes(
    index: SlideIndex, tmp_path: Path, workers: str
) -> None:
    out = tmp_path / "ex port"
    # units of 8 tiles, so that two workers each have some
    args = ("export", str(index.path), "--out", str(out), "--no-progress", "--shard-size", "8")
    args += ("--workers", workers)
    done = run_limited(60_000, *args, "--image-format", "png")  # a 256 px PNG is larger
    said_once(done, str(out))
    # the worker's error, not "worker process died" (it is the disk, not memory)
    assert done.returncode == 1 and "died" not in done.stderr, done.stderr
    assert leftovers(out) == []
    assert not any(p.stat().st_size == 0 for p in out.rglob("*.png"))
    again = run_limited(None, *args, "--image-format", "png")
    assert again.returncode == 0, again.stderr
    report = json.loads((out / "export.json").read_text())
    assert report["tiles"] == len(index)


def test_images_on_a_full_disk_are_not_left_half_written(index: SlideIndex, tmp_path: Path) -> None:
    for command in ("inspect", "mosaic"):
        target = tmp_path / f"{command}.png"
        done = run_limited(4096, command, str(index.path), "--out", str(target))
        said_once(done, str(target))
        assert not target.exists() and leftovers(tmp_path) == []


def test_features_on_a_full_disk_keep_finished_slides(index: SlideIndex, tmp_path: Path) -> None:
    pytest.importorskip("h5py")
    out = tmp_path / "features"
    args = ("features", str(index.path), "--out", str(out), "--model", "tests.feature_models:tiny")
    # no worker processes: the size limit would also stop torch's shared memory files
    done = run_limited(2000, *args, "--workers", "0", "--no-progress")
    said_once(done, str(out))
    assert leftovers(out) == []
    again = run_limited(None, *args, "--no-progress")
    assert again.returncode == 0, again.stderr


def test_verbose_shows_the_traceback(index: SlideIndex, tmp_path: Path) -> None:
    done = run_limited(4096, "inspect", str(index.path), "--out", str(tmp_path / "i.png"), "-v")
    assert done.returncode != 0 and "Traceback" in done.stderr
    assert os.path.exists(index.path)
