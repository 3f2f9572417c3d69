"""Missing and unreadable slides are slide faults: found early, reported once, never quarantined
tile by tile, and never the reason a rebuild loses tiles."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import corrupt_rows
from wsi_loader import SlideIndex, SlideNotFoundError, TileDataset, build_index, make_loader
from wsi_loader.cli import main
from wsi_loader.export import export_index
from wsi_loader.index._quarantine import Quarantine


def _build(archive: Path, out: Path) -> SlideIndex:
    return build_index([archive], out, tile_size=256, level=0, min_tissue=0.0, root=str(archive))


def test_moved_archive_fails_early_naming_the_slides_and_the_root(
    archive: Path, tmp_path: Path
) -> None:
    index = _build(archive, tmp_path / "idx")
    tiles = len(index)
    moved = tmp_path / "elsewhere"
    archive.rename(moved)
    for start in (
        lambda: TileDataset(tmp_path / "idx"),
        lambda: make_loader(tmp_path / "idx", batch_size=8, num_workers=0),
        lambda: export_index(tmp_path / "idx", tmp_path / "export"),
    ):
        with pytest.raises(SlideNotFoundError) as caught:
            start()
        message = str(caught.value)
        assert "2 of 2 slides" in message and "bad.svs" in message and "good.svs" in message
        assert "root" in message and str(archive) in message
    assert not (tmp_path / "export").exists()  # nothing written
    assert Quarantine(tmp_path / "idx" / "quarantine.jsonl").read() == []
    # the advice works: the new root reads everything
    assert len(TileDataset(tmp_path / "idx", root=str(moved))) == tiles
    # and after the folder is back, a rebuild keeps every tile
    moved.rename(archive)
    assert len(_build(archive, tmp_path / "idx")) == tiles


def test_missing_slides_can_be_left_out_with_a_warning(
    archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    index = _build(archive, tmp_path / "idx")
    (archive / "bad.svs").unlink()
    with caplog.at_level(logging.WARNING):
        ds = TileDataset(tmp_path / "idx", missing_slides="exclude")
    assert "bad.svs" in caplog.text and "leaving out 1 of 2 slides" in caplog.text
    good = next(i for i, s in enumerate(index.slides) if s.path == "good.svs")
    assert len(ds) == index.slides[good].tiles
    assert set(ds.index.columns["slide_id"].tolist()) == {good}
    batch = next(iter(make_loader(ds, batch_size=16, num_workers=0)))
    assert bool(batch.ok.all())


@pytest.mark.parametrize("workers", [0, 2])
def test_slide_vanishing_mid_run_is_one_slide_fault(
    archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, workers: int
) -> None:
    index = _build(archive, tmp_path / "idx")
    ds = TileDataset(index)
    (archive / "good.svs").unlink()  # after the start check: gone mid-run
    good = next(i for i, s in enumerate(index.slides) if s.path == "good.svs")
    with caplog.at_level(logging.WARNING):
        batches = list(make_loader(ds, batch_size=32, num_workers=workers, shuffle=False))
    slide_id = np.concatenate([b.slide_id.numpy() for b in batches])
    ok = np.concatenate([b.ok.numpy() for b in batches])
    assert not ok[slide_id == good].any()
    bad_rows = set(corrupt_rows(index).tolist())
    rows = np.concatenate([b.rows.numpy() for b in batches])
    others = (slide_id != good) & ~np.isin(rows, list(bad_rows))
    assert ok[others].all()
    records = Quarantine(tmp_path / "idx" / "quarantine.jsonl").read()
    slide_records = [r for r in records if r["kind"] == "slide"]
    assert len(slide_records) == 1 and slide_records[0]["path"] == "good.svs"
    assert slide_records[0]["fingerprint"] == index.slides[good].fingerprint
    assert not [r for r in records if r["kind"] == "tile" and r["path"] == "good.svs"]
    if workers == 0:  # worker logs go to their own processes
        assert caplog.text.count("good.svs cannot be read") == 1


def test_rebuild_ignores_slide_records_and_records_of_older_slide_versions(
    archive: Path, tmp_path: Path, make_slide
) -> None:  # type: ignore[no-untyped-def]
    index = _build(archive, tmp_path / "idx")
    good = next(i for i, s in enumerate(index.slides) if s.path == "good.svs")
    record = index.slides[good]
    rows = np.flatnonzero(index.columns["slide_id"] == good)[:2]
    q = index.quarantine
    q.append_slide(
        {"slide_id": good, "path": "good.svs", "fingerprint": record.fingerprint, "error": "gone"}
    )
    x0, y0 = (int(index.columns[c][rows[0]]) for c in ("l0_x", "l0_y"))
    x1, y1 = (int(index.columns[c][rows[1]]) for c in ("l0_x", "l0_y"))
    q.append(
        {
            "slide_id": good,
            "path": "good.svs",
            "fingerprint": record.fingerprint,
            "x": x0,
            "y": y0,
            "error": "bad",
        }
    )
    q.append(
        {
            "slide_id": good,
            "path": "good.svs",
            "fingerprint": "an older version",
            "x": x1,
            "y": y1,
            "error": "bad",
        }
    )
    rebuilt = _build(archive, tmp_path / "idx")
    # only the tile recorded on this version of the slide is left out
    assert rebuilt.slides[good].tiles == record.tiles - 1
    # a rewritten slide: its old records exclude nothing
    shutil.copy(make_slide(width=2560, height=2048, seed=77), archive / "good.svs")
    again = _build(archive, tmp_path / "idx")
    assert again.slides[good].tiles == record.tiles


def test_quarantine_command_lists_clears_and_retries(
    archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index = _build(archive, tmp_path / "idx")
    out = str(tmp_path / "idx")
    ds = TileDataset(index)
    ds.reader.read(corrupt_rows(index))  # four corrupt tiles of bad.svs get quarantined
    good = next(i for i, s in enumerate(index.slides) if s.path == "good.svs")
    ds.reader.slide_faults.clear()
    index.quarantine.append_slide(
        {
            "slide_id": good,
            "path": "good.svs",
            "fingerprint": index.slides[good].fingerprint,
            "error": "was missing for a while",
        }
    )
    assert main(["quarantine", out, "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert sorted(r["kind"] for r in records) == ["slide"] + ["tile"] * 4
    assert main(["info", out]) == 0
    assert "quarantine: 4 tile and 1 slide records" in capsys.readouterr().out
    # retry: the slide opens now (record cleared), the corrupt tiles still fail (kept)
    assert main(["quarantine", out, "--retry"]) == 0
    assert "1 records cleared" in capsys.readouterr().err
    assert [r["kind"] for r in index.quarantine.read()] == ["tile"] * 4
    assert main(["quarantine", out]) == 0
    listed = capsys.readouterr()
    assert listed.out.count("bad.svs") == 4 and "4 tile and 0 slide records" in listed.err
    assert main(["quarantine", out, "--clear", "--slide", "good"]) == 0
    assert len(index.quarantine.read()) == 4  # other slides' records stay
    assert main(["quarantine", out, "--clear", "--slide", "bad.svs"]) == 0
    assert index.quarantine.read() == []


def test_retry_reads_tiles_a_rebuild_left_out(archive: Path, tmp_path: Path) -> None:
    index = _build(archive, tmp_path / "idx")
    bad = next(i for i, s in enumerate(index.slides) if s.path == "bad.svs")
    row = int(np.flatnonzero(index.columns["slide_id"] == bad)[0])  # a good tile of bad.svs
    x, y = (int(index.columns[c][row]) for c in ("l0_x", "l0_y"))
    index.quarantine.append(
        {
            "slide_id": bad,
            "path": "bad.svs",
            "x": x,
            "y": y,
            "level": 0,
            "fingerprint": index.slides[bad].fingerprint,
            "error": "flaky",
        }
    )
    rebuilt = _build(archive, tmp_path / "idx")
    assert rebuilt.slides[bad].tiles == index.slides[bad].tiles - 1
    assert main(["quarantine", str(tmp_path / "idx"), "--retry"]) == 0
    assert index.quarantine.read() == []
    assert _build(archive, tmp_path / "idx").slides[bad].tiles == index.slides[bad].tiles


@pytest.mark.parametrize("same_size", [False, True])
def test_a_slide_replaced_under_its_name_is_a_slide_fault(
    archive: Path, tmp_path: Path, make_slide, same_size: bool
) -> None:  # type: ignore[no-untyped-def]
    index = _build(archive, tmp_path / "idx")
    good = next(i for i, s in enumerate(index.slides) if s.path == "good.svs")
    ds = TileDataset(index)  # the start check passes: the slide is still the indexed one
    other = make_slide(width=2560, height=2048, seed=99).read_bytes()
    if same_size:  # defeats a size check: only the contents tell
        size = (archive / "good.svs").stat().st_size
        other = other[:size].ljust(size, b"\0")
    (archive / "good.svs").write_bytes(other)
    rows = np.flatnonzero(index.columns["slide_id"] == good)[:8]
    batch = ds.read_batch(rows.tolist())
    assert not batch.ok.any()
    records = [r for r in index.quarantine.read() if r["path"] == "good.svs"]
    assert [r["kind"] for r in records] == ["slide"]
    assert "not the slide that was indexed" in records[0]["error"]


def test_touching_a_slide_is_not_a_change(archive: Path, tmp_path: Path) -> None:
    import os

    index = _build(archive, tmp_path / "idx")
    os.utime(archive / "good.svs", ns=(1, 1))
    good = next(i for i, s in enumerate(index.slides) if s.path == "good.svs")
    rows = np.flatnonzero(index.columns["slide_id"] == good)[:8]
    assert bool(TileDataset(index).read_batch(rows.tolist()).ok.all())


@pytest.mark.parametrize("vanished", ["slide", "tiles"])
def test_failed_reads_leave_no_buffer_in_cyclic_garbage(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vanished: str
) -> None:
    """A failed read keeps nothing alive through reference cycles (an exception stored where
    its own traceback's frames can reach it): with ``num_workers=0`` each batch buffer of a
    vanished slide waited for a full collection, and resident memory climbed by gigabytes."""
    import gc
    import types
    import weakref

    import torch

    from wsi_loader.dataset import _transport as transport

    buffers: list[weakref.ref[np.ndarray]] = []

    def tracked_buffer(shape: tuple[int, ...], shared: bool) -> torch.Tensor:
        array = np.empty(shape, dtype=np.uint8)
        buffers.append(weakref.ref(array))
        return torch.from_numpy(array)

    monkeypatch.setattr(transport, "fresh_buffer", tracked_buffer)
    index = _build(archive, tmp_path / "idx")
    ds = TileDataset(index)
    if vanished == "slide":
        (archive / "good.svs").unlink()  # every read of it is a slide fault
        good = next(i for i, s in enumerate(index.slides) if s.path == "good.svs")
        rows = np.flatnonzero(index.columns["slide_id"] == good)[:16]
    else:
        rows = corrupt_rows(index)  # tile faults, retried and recorded
    loader = make_loader(
        ds, batch_size=len(rows), num_workers=0, sampler=rows.tolist(), reuse_buffers=False
    )
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(3):
            batch = next(iter(loader))
            assert not bool(batch.ok.any())
            del batch
        alive = sum(ref() is not None for ref in buffers)  # before any collection
        gc.collect()
        frames = [o for o in gc.garbage if isinstance(o, types.FrameType)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert len(buffers) == 3
    assert alive == 0  # each freed as soon as its batch was dropped
    assert not [f.f_code.co_qualname for f in frames if "wsi_loader" in f.f_code.co_filename]


def test_tile_failures_are_one_warning_per_slide_with_the_count(
    index: SlideIndex, caplog: pytest.LogCaptureFixture
) -> None:
    """13% of a slide failing said nothing: now one WARNING per slide per process, with how
    many of the slide's tiles in that batch failed; later failures are counted, not logged."""
    bad = next(i for i, s in enumerate(index.slides) if s.path.endswith("bad.svs"))
    rows = np.flatnonzero(index.columns["slide_id"] == bad)
    assert set(corrupt_rows(index).tolist()) <= set(rows.tolist())
    ds = TileDataset(index)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # epochs
            loader = make_loader(ds, batch_size=len(rows), num_workers=0, sampler=rows.tolist())
            for batch in loader:
                assert int((~batch.ok).sum()) == 4
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1, [r.getMessage() for r in said]
    message = said[0].getMessage()
    assert "bad.svs" in message and f"4 of {len(rows)} tiles" in message
    assert "quarantine.jsonl" in message  # where the others are
    assert ds.reader.failure_count == 4 * 3  # every failure still counted


def test_a_slide_truncated_mid_epoch_is_one_warning(
    archive: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """tifffile logged its complaints about the truncated file (invalid page offsets) at
    every reopen: 336 lines over 5 epochs. Now the slide fault is the one line."""
    import os

    _build(archive, tmp_path / "idx")
    ds = TileDataset(tmp_path / "idx")
    loader = make_loader(ds, batch_size=16, num_workers=0, shuffle=False)
    next(iter(loader))  # handles open, layouts parsed
    path = archive / "good.svs"
    os.truncate(path, path.stat().st_size * 2 // 3)
    with caplog.at_level(logging.DEBUG, logger="tifffile"), caplog.at_level(logging.WARNING):
        for _ in range(5):
            batches = list(loader)
    good = next(i for i, s in enumerate(ds.index.slides) if s.path == "good.svs")
    slide_id = np.concatenate([b.slide_id.numpy() for b in batches])
    assert not np.concatenate([b.ok.numpy() for b in batches])[slide_id == good].any()
    said = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [text for name, text in said if not name.startswith("wsi_loader")], said
    about = [text for _, text in said if "good.svs" in text]
    assert len(about) == 1 and "not the slide that was indexed" in about[0], said
