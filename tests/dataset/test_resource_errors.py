"""Resource errors are not data errors: retried with backoff, reported, never quarantined;
files that are not regular files never hang a build or a loader; the open-file limit bounds
the handle pool."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from wsi_loader import SlideIndex, TileDataset, build_index
from wsi_loader.errors import ConfigError, LoaderTimeoutError
from wsi_loader.slides import _tiff


def _failing_raw(monkeypatch: pytest.MonkeyPatch, code: int, times: int | None) -> list[int]:
    real = _tiff.TiffReader._raw
    calls: list[int] = []

    def raw(self: _tiff.TiffReader, level: int, index: int) -> bytes:
        calls.append(index)
        if times is None or len(calls) <= times:
            raise OSError(code, os.strerror(code))
        return real(self, level, index)

    monkeypatch.setattr(_tiff.TiffReader, "_raw", raw)
    return calls


def test_a_passing_resource_error_is_retried_and_the_tile_is_good(
    index: SlideIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = TileDataset(index, decode_threads=1)
    expected = ds.reader.read([0]).pixels.copy()
    _failing_raw(monkeypatch, errno.EMFILE, times=2)
    result = ds.reader.read([0])
    assert bool(result.ok[0]) and np.array_equal(result.pixels, expected)
    assert index.quarantine.read() == []


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOMEM, errno.EMFILE])
def test_a_lasting_resource_error_is_reported_never_quarantined(
    index: SlideIndex, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    ds = TileDataset(index, decode_threads=1, retries=1)
    _failing_raw(monkeypatch, code, times=None)
    with caplog.at_level(logging.WARNING):
        result = ds.reader.read([0, 1, 2])
    assert not result.ok.any()
    assert all(e is not None and e.startswith("resource error") for e in result.errors)
    assert index.quarantine.read() == []  # a rebuild keeps every tile
    assert {f["kind"] for f in ds.failures} == {"transient"}
    assert caplog.text.count("not quarantined") == 1  # once per slide per process
    assert os.strerror(code) in caplog.text


def test_the_handle_pool_fits_the_file_limit(tmp_path: Path) -> None:
    code = (
        "import logging, resource, sys\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))\n"
        "from wsi_loader.slides._pool import HandlePool\n"
        "print(HandlePool(max_open=64).open_limit, HandlePool(max_open=4).open_limit)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["9", "4"]
    assert "does not fit the file limit" in done.stderr and "ulimit -n 100" in done.stderr


def test_a_fifo_named_like_a_slide_does_not_hang_the_index(archive: Path, tmp_path: Path) -> None:
    os.mkfifo(archive / "pipe.svs")
    index = build_index([archive], tmp_path / "idx", level=0, min_tissue=0.0)
    pipe = next(s for s in index.slides if s.path.endswith("pipe.svs"))
    assert pipe.status == "failed" and "not a regular file" in (pipe.error or "")
    assert sum(s.status == "ok" for s in index.slides) == 2


def test_a_fifo_replacing_a_slide_mid_run_does_not_hang_the_loader(
    archive: Path, tmp_path: Path
) -> None:
    index = build_index([archive], tmp_path / "idx", level=0, min_tissue=0.0)
    ds = TileDataset(index)
    good = next(i for i, s in enumerate(index.slides) if s.path.endswith("good.svs"))
    (archive / "good.svs").unlink()
    os.mkfifo(archive / "good.svs")
    rows = np.flatnonzero(index.columns["slide_id"] == good)[:4]
    assert not ds.read_batch(rows.tolist()).ok.any()
    records = index.quarantine.read()
    assert [r["kind"] for r in records] == ["slide"] and "not a regular file" in records[0]["error"]


def test_a_fifo_replacing_an_evicted_slide_does_not_hang_its_reopen(
    archive: Path, tmp_path: Path
) -> None:
    """A raw-read slide evicted from the handle pool keeps its layout and is reopened with one
    open() call: that call must not block on a FIFO either (any archive of more slides than
    ``max_open_slides`` reopens slides all the time)."""
    index = build_index([archive], tmp_path / "idx", level=0, min_tissue=0.0)
    ds = TileDataset(index, max_open_slides=1)
    starts = index.slide_starts()
    row = {Path(s.path).name: int(starts[i]) for i, s in enumerate(index.slides)}
    assert ds.read_batch([row["good.svs"]]).ok.all()
    assert ds.read_batch([row["bad.svs"]]).ok.all()  # good.svs evicted, its layout kept
    (archive / "good.svs").unlink()
    os.mkfifo(archive / "good.svs")
    assert not ds.read_batch([row["good.svs"]]).ok.any()
    records = index.quarantine.read()
    assert [r["kind"] for r in records] == ["slide"] and "not a regular file" in records[0]["error"]


@pytest.mark.parametrize("backend", ["tiff", "openslide"])
def test_readers_refuse_a_fifo(tmp_path: Path, backend: str) -> None:
    """Every way a reader opens a file refuses anything but a regular file, also when asked
    for a backend directly (no stat before it in `open_slide`)."""
    from wsi_loader.errors import SlideOpenError
    from wsi_loader.slides._openslide import OpenSlideReader

    os.mkfifo(tmp_path / "pipe.svs")
    reader = _tiff.TiffReader if backend == "tiff" else OpenSlideReader
    with pytest.raises(SlideOpenError, match="not a regular file"):
        reader(str(tmp_path / "pipe.svs"))


def test_an_export_unit_with_resource_errors_stays_incomplete(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsi_loader.errors import TransientReadError
    from wsi_loader.export import export_index

    index = build_index([archive / "good.svs"], tmp_path / "idx", level=0, min_tissue=0.0)
    _failing_raw(monkeypatch, errno.EIO, times=None)
    with pytest.raises(TransientReadError, match="run the same export again"):
        export_index(index, tmp_path / "out", format="webdataset", shard_size=100)
    assert not list((tmp_path / "out").glob("shard-*.tar"))
    monkeypatch.undo()
    report = export_index(index, tmp_path / "out", format="webdataset", shard_size=100)
    assert report.tiles == len(index) and report.failed == 0
    assert index.quarantine.read() == []


def test_a_stuck_worker_is_a_timeout_naming_its_slide(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsi_loader import make_loader

    index = build_index([archive], tmp_path / "idx", level=0, min_tissue=0.0)
    real = _tiff.TiffReader._raw

    def hangs_on_bad(self: _tiff.TiffReader, level: int, i: int) -> bytes:
        if self.path.endswith("bad.svs"):
            import time

            time.sleep(3600)  # a share that stopped answering
        return real(self, level, i)

    monkeypatch.setattr(_tiff.TiffReader, "_raw", hangs_on_bad)
    loader = make_loader(
        index, batch_size=len(index), num_workers=1, timeout=30, multiprocessing_context="fork"
    )  # 30 s: the stuck read never ends; the good ones must not come near it when busy
    with pytest.raises(LoaderTimeoutError, match=r"timeout=30(\.0)? s.*bad\.svs") as info:
        next(iter(loader))
    assert isinstance(info.value, TimeoutError) and info.value.seconds == 30
    bad = [i for i, s in enumerate(index.slides) if s.path.endswith("bad.svs")]
    assert info.value.slide_ids == bad and info.value.paths == [index.slide_path(bad[0])]
    # the next epoch of the (persistent) workers, still stuck: the same error, not torch's
    # bare RuntimeError from restarting them
    with pytest.raises(LoaderTimeoutError, match=r"timeout=30(\.0)? s.*bad\.svs") as again:
        next(iter(loader))
    assert again.value.slide_ids == bad


def test_a_timeout_without_workers_is_an_error(archive: Path, tmp_path: Path) -> None:
    """A read in the process that asked for it cannot be given up: a timeout with
    num_workers=0 was silently ignored, so a hung read still waited forever."""
    from wsi_loader import make_loader

    index = build_index([archive], tmp_path / "idx", level=0, min_tissue=0.9)
    with pytest.raises(ConfigError, match="timeout needs worker processes"):
        make_loader(index, num_workers=0, timeout=5)
