"""Indexes that cannot be written to: a shared index on a read-only mount, or in a folder
owned by another user. Reading must go on; failures stay data (``ok``, ``failures``), the log
says once (not once per tile) that they are not recorded, and ``quarantine=FILE`` records them
somewhere writable.

The tests run as root in CI, where file modes do not stop writes: the quarantine's lock path
is made a folder instead, which fails every write the way a read-only mount does.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import corrupt_rows
from wsi_loader.dataset import TileDataset, make_loader
from wsi_loader.device._loader import DeviceLoader
from wsi_loader.errors import ConfigError
from wsi_loader.index import SlideIndex


def unwritable(index: SlideIndex) -> None:
    (index.path / "quarantine.jsonl.lock").mkdir()


def warnings_about_the_quarantine(caplog: pytest.LogCaptureFixture) -> list[str]:
    """WARNINGs that mention the quarantine, besides the one per slide about failed tiles
    (whose path, in these tests' folders, says 'quarantine' too)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and "quarantine" in r.getMessage()
        and "tiles of slide" not in r.getMessage()
    ]


def test_an_unwritable_quarantine_is_reported_once_and_reading_goes_on(
    index: SlideIndex, caplog: pytest.LogCaptureFixture
) -> None:
    unwritable(index)
    bad = corrupt_rows(index)
    ds = TileDataset(index)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            batch = ds.read_batch(np.arange(len(index)).tolist())
            assert set(np.flatnonzero(~batch.ok.numpy()).tolist()) == set(bad.tolist())
        assert not ds[int(bad[0])]["ok"]
    said = warnings_about_the_quarantine(caplog)
    assert len(said) == 1, said
    assert "cannot write" in said[0] and "quarantine=" in said[0]
    assert str(index.path) in said[0]
    assert sorted({f["row"] for f in ds.failures}) == sorted(bad.tolist())


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_quarantine_option_records_failures_in_another_file(
    index: SlideIndex, tmp_path: Path, workers: int, context: str | None
) -> None:
    unwritable(index)
    elsewhere = tmp_path / "mine" / "failed reads.jsonl"
    elsewhere.parent.mkdir()
    loader = make_loader(
        index.path,
        batch_size=16,
        num_workers=workers,
        multiprocessing_context=context,
        quarantine=str(elsewhere),
    )
    failed = [int(r) for b in loader for r, ok in zip(b.rows, b.ok, strict=True) if not ok]
    bad = sorted(corrupt_rows(index).tolist())
    assert sorted(failed) == bad
    records = [json.loads(line) for line in elsewhere.read_text().splitlines()]
    assert sorted(r["row"] for r in records) == bad
    assert not (index.path / "quarantine.jsonl").exists()
    # the same file leaves them out, and says what it holds
    kept = TileDataset(index.path, quarantine=str(elsewhere), exclude_quarantined=True)
    assert len(kept) == len(index) - len(bad) and kept.index.excluded == len(bad)
    assert kept.index.quarantine.path == elsewhere
    assert len(TileDataset(index.path, exclude_quarantined=True)) == len(index)


def test_quarantine_option_on_an_opened_index_and_in_views(
    index: SlideIndex, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "q.jsonl"
    opened = SlideIndex.open(index.path, quarantine=elsewhere)
    assert opened.quarantine.path == elsewhere
    assert opened.view(split=None).quarantine.path == elsewhere
    ds = TileDataset(index, quarantine=str(elsewhere))  # an index opened without it
    assert ds.index.quarantine.path == elsewhere
    ds.read_batch(corrupt_rows(index).tolist())
    assert len(ds.index.quarantine.tile_records()) == len(corrupt_rows(index))
    assert index.quarantine.read() == []


def test_quarantine_option_in_a_missing_folder_is_a_config_error(
    index: SlideIndex, tmp_path: Path
) -> None:
    missing = tmp_path / "not mounted" / "q.jsonl"
    with pytest.raises(ConfigError, match="not mounted") as err:
        TileDataset(index, quarantine=str(missing))
    assert err.value.key == "quarantine"
    with pytest.raises(ConfigError, match="a folder"):
        TileDataset(index, quarantine=str(tmp_path))


def test_device_decode_survives_an_unwritable_quarantine(
    index: SlideIndex, caplog: pytest.LogCaptureFixture
) -> None:
    unwritable(index)
    loader = make_loader(index, batch_size=8, num_workers=0, shuffle=False, decode="device")
    with caplog.at_level(logging.WARNING):
        oks = [b["ok"] for b in DeviceLoader(loader, "cpu")]
    failed = np.flatnonzero(~np.concatenate([o.numpy() for o in oks]))
    assert failed.tolist() == sorted(corrupt_rows(index).tolist())
    said = [m for m in warnings_about_the_quarantine(caplog) if "cannot write" in m]
    assert len(said) == 1, said


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsi_loader.cli", *args], check=False, capture_output=True, text=True
    )


def test_cli_reads_and_writes_the_quarantine_option(index: SlideIndex, tmp_path: Path) -> None:
    unwritable(index)
    elsewhere = tmp_path / "q.jsonl"
    out = tmp_path / "export"
    done = cli(
        "export", str(index.path), "--out", str(out), "--no-progress",
        "--quarantine", str(elsewhere),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "cannot write" not in done.stderr
    bad = len(corrupt_rows(index))
    assert len(elsewhere.read_text().splitlines()) == bad
    listed = cli("quarantine", str(index.path), "--json", "--quarantine", str(elsewhere))
    assert len(json.loads(listed.stdout)) == bad
    info = cli("info", str(index.path), "--json", "--quarantine", str(elsewhere))
    summary = json.loads(info.stdout)
    assert summary["quarantine"]["tiles"] == bad
    assert summary["quarantine_path"] == str(elsewhere)
    cleared = cli("quarantine", str(index.path), "--clear", "--quarantine", str(elsewhere))
    assert cleared.returncode == 0, cleared.stderr
    assert elsewhere.read_text() == ""
