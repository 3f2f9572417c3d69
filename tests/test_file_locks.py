"""File systems without file locks: Lustre mounted without ``flock`` (a common HPC default,
where flock() fails with ENOSYS) and NFS without a lock manager (ENOLCK). Processes share the
index, its quarantine, export parts and local copies through flock; where there are none,
everything must still work, said once, instead of failing with "Function not implemented"."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import corrupt_rows
from wsi_loader import SlideIndex, TileDataset, build_index, files
from wsi_loader.export import export_index


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP])
def test_everything_works_without_file_locks_and_says_so_once(
    archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch, code: int,
) -> None:  # fmt: skip
    def flock(fd: int, operation: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(files, "_said", set())  # said once per process: this test's process
    out = tmp_path / "idx"
    labels = str(archive / "labels.csv")  # (image-folder exports hold labelled tiles)
    index = build_index([archive], out, tile_size=256, level=0, min_tissue=0.0, labels=labels)
    rebuilt = build_index(
        [archive], out, tile_size=256, level=0, min_tissue=0.0, stride=128, labels=labels
    )
    assert len(rebuilt) > len(index)  # a new generation (the old one may be deleted)
    opened = SlideIndex.open(out)
    result = TileDataset(opened).read_batch(corrupt_rows(opened)[:2].tolist())
    assert not result.ok.any() and len(opened.quarantine.read()) == 2  # appended
    report = export_index(opened, tmp_path / "export", workers=1)
    assert report.tiles + report.failed + report.quarantined == len(opened)  # all accounted
    with files.locked(str(tmp_path / "copy.lock")):
        pass
    said = [r for r in caplog.records if "file locks" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]  # one file system, said once
    assert os.strerror(code) in said[0].getMessage()
    assert np.array_equal(SlideIndex.open(out).columns["l0_x"], rebuilt.columns["l0_x"])


def test_a_build_already_running_is_still_refused_where_locks_work(
    archive: Path, tmp_path: Path
) -> None:
    from wsi_loader.errors import IndexFormatError
    from wsi_loader.index._table_writer import exclusive_build

    with (
        exclusive_build(tmp_path / "idx"),
        pytest.raises(IndexFormatError, match="another build is running"),
    ):
        build_index([archive], tmp_path / "idx", tile_size=256, level=0)
