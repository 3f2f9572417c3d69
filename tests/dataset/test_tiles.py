from __future__ import annotations

import json
import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import corrupt_rows
from wsi_loader.cli import main
from wsi_loader.dataset import DistributedTileSampler, TileDataset
from wsi_loader.dataset._cores import usable_cores
from wsi_loader.index import Quarantine, SlideIndex


def test_sample_contract(index: SlideIndex) -> None:
    ds = TileDataset(index)
    sample = ds[3]
    assert sample["image"].dtype == torch.uint8 and sample["image"].shape == (3, 256, 256)
    assert sample["row"] == 3 and sample["ok"] is True and sample["substituted"] is False
    slide_id = int(index.columns["slide_id"][3])
    assert sample["slide_id"] == slide_id
    assert (sample["x"], sample["y"]) == (
        int(index.columns["l0_x"][3]),
        int(index.columns["l0_y"][3]),
    )
    assert ds.label_names[sample["label"]] == index.slides[slide_id].label
    assert ds[-1]["row"] == len(ds) - 1
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_items_are_contiguous_chw_copies_of_the_tiles(index: SlideIndex) -> None:
    """Per-item images are laid out (3, H, W) in memory, so the default collate's stack is a
    plain copy rather than a transposing one; the pixels are the batch read's."""
    ds = TileDataset(index)
    rows = [0, 5, len(ds) - 1]
    tiles = ds.read_batch(rows).images.numpy()
    for tile, sample in zip(tiles, ds.__getitems__(rows), strict=True):
        assert sample["image"].is_contiguous()
        assert np.array_equal(sample["image"].numpy(), tile.transpose(2, 0, 1))
    assert ds[5]["image"].is_contiguous()


def test_transform_hook(index: SlideIndex) -> None:
    ds = TileDataset(index, transform=lambda img: img[:, :8, :8].float() / 255)
    assert ds[0]["image"].shape == (3, 8, 8)


def test_getitems_keeps_order_while_grouping_by_slide(index: SlideIndex) -> None:
    ds = TileDataset(index)
    rows = [len(ds) - 1, 0, len(ds) // 2, 1]
    batch = ds.__getitems__(rows)
    assert [s["row"] for s in batch] == rows
    for sample in batch:
        assert torch.equal(sample["image"], ds[sample["row"]]["image"])


def test_pickles_small_without_handles(index: SlideIndex) -> None:
    ds = TileDataset(index)
    ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000  # no tile columns, no handles
    clone = pickle.loads(blob)
    assert len(clone.reader.pool) == 0
    assert torch.equal(clone[5]["image"], ds[5]["image"])


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_dataloader_epoch_with_real_workers(
    index: SlideIndex, workers: int, context: str | None
) -> None:
    ds = TileDataset(index, on_error="fill")
    loader = DataLoader(
        ds,
        batch_size=8,
        num_workers=workers,
        multiprocessing_context=context,
        sampler=DistributedTileSampler(ds, shuffle=True, seed=1),
    )
    seen, not_ok = [], []
    for batch in loader:
        assert batch["image"].shape[1:] == (3, 256, 256) and batch["image"].dtype == torch.uint8
        seen += batch["row"].tolist()
        not_ok += batch["row"][~batch["ok"]].tolist()
    assert sorted(seen) == list(range(len(ds)))
    assert sorted(not_ok) == sorted(corrupt_rows(index).tolist())
    records = index.quarantine.read()
    assert sorted({r["row"] for r in records}) == sorted(not_ok)


def _append_many(path: str, worker: int) -> None:
    q = Quarantine(path)
    for i in range(200):
        q.append({"slide_id": worker, "path": f"s{worker}.svs", "x": i, "y": 0, "error": "x" * 300})


def test_concurrent_quarantine_writers_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "quarantine.jsonl")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(path, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    records = Quarantine(path).read()
    assert len(records) == 800
    assert {(r["slide_id"], r["x"]) for r in records} == {
        (w, i) for w in range(4) for i in range(200)
    }


def test_torn_quarantine_record_does_not_hide_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "quarantine.jsonl"
    q = Quarantine(path)
    q.append({"slide_id": 0, "path": "a", "x": 1, "y": 2, "error": "e"})
    with open(path, "ab") as fh:
        fh.write(b'{"slide_id": 0, "path": "a", "x"')  # a writer killed mid-record
    q.append({"slide_id": 0, "path": "a", "x": 3, "y": 4, "error": "e"})
    assert [r["x"] for r in q.read()] == [1, 3]
    assert "torn quarantine record" in caplog.text


def test_info_json_lists_quarantine_and_index_can_exclude(
    index: SlideIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = TileDataset(index)
    bad = corrupt_rows(index)
    ds.__getitems__(bad.tolist())
    assert main(["info", str(index.path), "--json"]) == 0
    quarantined = json.loads(capsys.readouterr().out)["quarantined"]
    assert len(quarantined) == len(bad)
    assert {"slide_id", "x", "y", "error"} <= quarantined[0].keys()
    excluded = TileDataset(index.path, exclude_quarantined=True)
    assert len(excluded) == len(index) - len(bad) and excluded.index.excluded == len(bad)
    loader = DataLoader(excluded, batch_size=64, num_workers=2, multiprocessing_context="spawn")
    assert all(bool(b["ok"].all()) for b in loader)


def test_dataset_follows_a_moved_archive(archive: Path, tmp_path: Path) -> None:
    from wsi_loader.index import build_index

    built = build_index([archive], tmp_path / "rooted", level=0, min_tissue=0.5, root=str(archive))
    moved = tmp_path / "moved"
    archive.rename(moved)
    ds = TileDataset(built.path, root=str(moved))
    assert ds[0]["ok"] and ds.index.slide_path(0).startswith(str(moved))


def test_memory_is_numpy_not_python_objects(index: SlideIndex) -> None:
    ds = TileDataset(index)
    for name, column in ds.index.columns.items():
        assert isinstance(column, np.ndarray), name


def test_from_config_section(index: SlideIndex, tmp_path: Path) -> None:
    from wsi_loader.config import load_config

    config = tmp_path / "c.yaml"
    config.write_text(
        "dataset:\n  on_error: substitute\n  retries: 0\n  max_open_slides: 2\n"
        "  decode_threads: 3\n  layout_cache_mb: 5\n"
    )
    ds = TileDataset.from_config(index, load_config(config).dataset)
    assert (ds.reader.on_error, ds.reader.retries, ds.reader.pool.max_open) == ("substitute", 0, 2)
    assert ds.threads_here() == 3 and ds.reader.pool.layout_cache_bytes == 5 * 2**20
    bad = int(corrupt_rows(index)[0])
    assert ds[bad]["substituted"] is True


class ThreadsPerWorker(torch.utils.data.Dataset[int]):
    def __init__(self, tiles: TileDataset) -> None:
        self.tiles = tiles

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return self.tiles.threads_here()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_decode_threads_divide_the_cores_among_reading_processes(
    index: SlideIndex, context: str
) -> None:
    cores = usable_cores()
    assert TileDataset(index).threads_here() == cores  # num_workers=0: this process reads
    assert TileDataset(index, decode_threads=5).threads_here() == 5
    loader = DataLoader(
        ThreadsPerWorker(TileDataset(index)),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=context,
    )
    assert set(loader) == {max(1, cores // 2)}
    with pytest.raises(ValueError, match="decode_threads"):
        TileDataset(index, decode_threads=0)


def test_batches_read_with_threads_match_one_thread(index: SlideIndex) -> None:
    rows = list(range(0, len(index), 2))
    one = TileDataset(index, decode_threads=1, record_failures=False).read_batch(rows)
    many = TileDataset(index, decode_threads=4, record_failures=False).read_batch(rows)
    assert torch.equal(one.images, many.images) and torch.equal(one.ok, many.ok)


def _append_one(path: str, done: Any) -> None:
    Quarantine(path).append({"slide_id": 0, "path": "s.svs", "x": 1, "y": 2, "error": "late"})
    done.set()


def test_quarantine_writers_wait_for_the_lock(tmp_path: Path) -> None:
    """An append must take the writers' lock (the torn-line check and `rewrite` rely on it)."""
    import fcntl
    import os

    q = Quarantine(tmp_path / "quarantine.jsonl")
    # spawn: a forked child would inherit the held lock's descriptor and wait on itself
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Event()
    fd = os.open(q.lock_path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        writer = ctx.Process(target=_append_one, args=(str(q.path), done))
        writer.start()
        assert not done.wait(1.0)  # blocked while another process holds the lock
        assert q.read() == []
    finally:
        os.close(fd)
    assert done.wait(300)  # a spawned child imports torch: slow on a busy machine
    writer.join()
    assert [r["error"] for r in q.read()] == ["late"]


def test_rewrite_keeps_appends_made_while_it_waited(tmp_path: Path) -> None:
    q = Quarantine(tmp_path / "quarantine.jsonl")
    for x in range(3):
        q.append({"slide_id": 0, "path": "s.svs", "x": x, "y": 0, "error": "e"})
    kept, removed = q.rewrite(lambda r: r["x"] != 1)
    assert (kept, removed) == (2, 1)
    q.append({"slide_id": 0, "path": "s.svs", "x": 9, "y": 0, "error": "e"})
    assert [r["x"] for r in q.read()] == [0, 2, 9]


def test_invalid_quarantine_records_are_skipped_not_fatal(
    index: SlideIndex, caplog: pytest.LogCaptureFixture
) -> None:
    path = index.path / "quarantine.jsonl"
    good = {"kind": "tile", "slide_id": 0, "path": index.slides[0].path, "x": 0, "y": 0}
    path.write_text(
        "\n".join(
            [
                json.dumps({**good, "x": 1e20}),
                '{"path": "a.svs", "x": Infinity, "y": 0}',
                "[" * 100000 + "]" * 100000,
                json.dumps({**good, "x": True}),
                json.dumps(good),
            ]
        )
        + "\n"
    )
    assert [r["x"] for r in Quarantine(path).read()] == [0]
    assert caplog.text.count("skipping") == 4  # one warning per bad line, naming it
    assert "quarantine.jsonl:3: skipping" in caplog.text
    assert len(SlideIndex.open(index.path, exclude_quarantined=True)) == len(index) - 1


def test_failures_kept_in_memory_are_bounded(
    index: SlideIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsi_loader.dataset import _failures as failures

    monkeypatch.setattr(failures, "FAILURES_KEPT", 10)
    ds = TileDataset(index, record_failures=False)
    bad = corrupt_rows(index)
    for _ in range(6):  # 24 failures, epoch after epoch
        ds.reader.read(bad)
    assert len(ds.failures) == 10 and ds.reader.failure_count == 24


def test_the_quarantine_never_writes_through_a_symlink(index: SlideIndex, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    (index.path / "quarantine.jsonl").symlink_to(target)
    ds = TileDataset(index)
    result = ds.reader.read(corrupt_rows(index))  # failures cannot be recorded: reads go on
    assert not result.ok.any()
    assert target.read_text() == "precious\n"
