"""Batches from worker processes travel through a ring of shared slots (`_transport`): the
same batches, ``ok`` masks and quarantine records as through torch's shared memory, with real
workers under fork, spawn and forkserver."""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import corrupt_rows
from wsi_loader.dataset import TileBatch, TileDataset, make_loader
from wsi_loader.dataset._batch import pack_columns, unpack_columns
from wsi_loader.dataset._loader import _RUNNING, TileLoader
from wsi_loader.dataset._transport import SlotRing
from wsi_loader.errors import LoaderWorkerDiedError
from wsi_loader.index import SlideIndex, build_index

FIELDS = ["images", "ok", "substituted", "rows", "slide_id", "x", "y", "label", "slide_label"]


def _loader(index: SlideIndex, start: str, ring: bool = True, **options: Any) -> TileLoader:
    loader = make_loader(
        index,
        batch_size=8,
        num_workers=2,
        multiprocessing_context=start,
        shuffle=False,
        prefetch_factor=2,
        **options,
    )
    loader.use_ring = ring
    return loader


def _in_ring(loader: TileLoader, images: torch.Tensor) -> bool:
    """Whether ``images`` lies in the consumer's mapping of the loader's ring."""
    ring = loader._ring
    if ring is None or ring._mapping is None:
        return False
    return 0 <= images.data_ptr() - ring._mapping.address < ring.size


def _epoch(loader: TileLoader) -> list[dict[str, Any]]:
    """Copies of an epoch's batches (each batch let go before the next, as a training loop
    does), and whether its pixels came in a slot of the loader's ring (``in_ring``)."""
    copies = []
    for batch in loader:
        copy: dict[str, Any] = {name: getattr(batch, name).clone() for name in FIELDS}
        copy["in_ring"] = _in_ring(loader, batch.images)
        copy["recycled"] = batch.recycled
        copies.append(copy)
    return copies


def _same(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        for name in FIELDS:
            assert torch.equal(a[name], b[name]), name


def _records(index: SlideIndex) -> list[dict[str, Any]]:
    """Quarantine records without when and by which process they were written."""
    records = [
        {k: v for k, v in r.items() if k not in ("time", "pid")} for r in index.quarantine.read()
    ]
    return sorted(records, key=repr)


def _second_index(index: SlideIndex, archive: Path, tmp_path: Path) -> SlideIndex:
    """The same slides indexed again: a quarantine file of its own."""
    return build_index(
        [archive],
        tmp_path / "idx2",
        tile_size=256,
        level=0,
        min_tissue=0.0,
        labels=str(archive / "labels.csv"),
    )


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_ring_batches_match_torch_transport(
    index: SlideIndex, archive: Path, tmp_path: Path, context: str
) -> None:
    """Corrupt tiles included: every field, the ``ok`` masks and the quarantine records are
    those of torch's transport; the pixels came through the ring (not torch's shared memory)."""
    other = _second_index(index, archive, tmp_path)
    assert corrupt_rows(index).size
    ring_loader = _loader(index, context)
    ring = _epoch(ring_loader)
    torch_batches = _epoch(_loader(other, context, ring=False))
    _same(ring, torch_batches)
    bad = set(corrupt_rows(index).tolist())
    assert not any(bool(b["ok"].all()) for b in ring if set(b["rows"].tolist()) & bad)
    assert all(b["recycled"] and b["in_ring"] for b in ring)
    assert all(b["recycled"] and not b["in_ring"] for b in torch_batches)
    assert ring_loader.ring_fallbacks == 0
    assert _records(index) == _records(other) != []


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_keep_one_ring_across_epochs(index: SlideIndex, context: str) -> None:
    loader = make_loader(
        index, batch_size=8, num_workers=2, multiprocessing_context=context, prefetch_factor=2
    )
    assert loader.persistent_workers
    ds = TileDataset(index)
    rings = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = []
        for batch in loader:
            expected = ds.read_batch(batch.rows.tolist())
            assert torch.equal(batch.images, expected.images)
            assert torch.equal(batch.ok, expected.ok)
            assert _in_ring(loader, batch.images)
            seen += batch.rows.tolist()
        assert sorted(seen) == list(range(len(index)))
        rings.append(loader._ring)
    assert rings[0] is rings[1] is not None  # the workers' ring, made once
    assert loader.ring_fallbacks == 0


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_consumer_holding_every_batch_gets_plain_batches(index: SlideIndex, context: str) -> None:
    """Every batch of two epochs kept: once a worker's slots are all held, its batches come
    through torch's shared memory (counted), never a wait for a slot. Let go, the slots are
    free again and the next epoch runs on the ring alone."""
    loader = make_loader(
        index, batch_size=4, num_workers=2, multiprocessing_context=context, prefetch_factor=2
    )
    held = [batch for epoch in range(2) for batch in loader]
    assert loader._ring is not None
    slots = loader._ring.workers * loader._ring.slots_per_worker
    assert len(held) > slots
    assert loader.ring_fallbacks == len(held) - slots
    assert sum(_in_ring(loader, b.images) for b in held) == slots
    ds = TileDataset(index, record_failures=False)
    for batch in held:
        expected = ds.read_batch(batch.rows.tolist())
        assert torch.equal(batch.images, expected.images)
        for name in ("ok", "x", "y", "slide_id", "label", "slide_label"):  # both ways
            assert torch.equal(getattr(batch, name), getattr(expected, name)), name
    before = loader.ring_fallbacks
    del held, batch
    gc.collect()
    assert all(_in_ring(loader, b.images) for b in loader)
    assert loader.ring_fallbacks == before


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_a_worker_killed_mid_epoch(index: SlideIndex, context: str) -> None:
    """A worker killed while the consumer holds batches of the ring: the loop fails naming it
    (as before), the batches received keep their pixels, and the next epoch's new workers
    read everything through a new ring."""
    loader = make_loader(
        index,
        batch_size=4,
        num_workers=2,
        multiprocessing_context=context,
        persistent_workers=False,
        shuffle=False,
    )
    batches = iter(loader)
    kept = [next(batches), next(batches)]
    first_ring = loader._ring
    (iterator,) = [it for it in _RUNNING if getattr(it, "_wsi_ring", None) is first_ring]
    victim = iterator._workers[0]
    del iterator
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(LoaderWorkerDiedError):
        for batch in batches:
            kept.append(batch)
    del batches
    ds = TileDataset(index)
    for batch in kept:
        assert torch.equal(batch.images, ds.read_batch(batch.rows.tolist()).images)
    again = _epoch(loader)
    assert loader._ring is not first_ring
    assert sorted(r for b in again for r in b["rows"].tolist()) == list(range(len(index)))
    assert all(b["in_ring"] for b in again)


def test_real_slide_through_the_ring(testdata: Path, tmp_path: Path) -> None:
    """A third-party Aperio slide, fork and spawn workers: the batches of torch's transport."""
    index = build_index(
        [testdata / "CMU-1-Small-Region.svs"], tmp_path / "idx", tile_size=256, level=0
    )
    for context in ("fork", "spawn"):
        ring = _epoch(_loader(index, context, record_failures=False))
        plain = _epoch(_loader(index, context, ring=False, record_failures=False))
        _same(ring, plain)
        assert all(b["in_ring"] for b in ring)


def test_a_ring_pickled_outside_a_process_start_carries_no_memory() -> None:
    ring = SlotRing(workers=1, slots_per_worker=2, slot_bytes=1000)
    clone = pickle.loads(pickle.dumps(ring))
    assert clone.take([(2, 2)]) is None  # not a worker, and no memory to map
    assert clone.slot_bytes == ring.slot_bytes and clone.token == ring.token
    ring.workers_started()
    ring.workers_started()  # once closed, stays closed


def test_forwarded_ring_batches_are_copied(index: SlideIndex) -> None:
    """A ring batch sent on to another process travels as torch's shared memory (a copy),
    never as a slot number, so the ring's reuse of the slot cannot change it."""
    loader = _loader(index, "fork")
    batch = next(iter(loader))
    clone = pickle.loads(pickle.dumps(batch))
    assert torch.equal(clone.images, batch.images)
    assert clone.images.data_ptr() != batch.images.data_ptr()


def _fields(batch: TileBatch) -> dict[str, Any]:
    """Every field of ``batch``: tensors as (dtype, shape, strides, a copy of the values)."""

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (value.dtype, tuple(value.shape), value.stride(), value.clone())
        if isinstance(value, list):
            return [copy(v) for v in value]
        return value

    return {f.name: copy(getattr(batch, f.name)) for f in dataclasses.fields(batch)}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


def _unicode_archive(archive: Path, tmp_path: Path, name: str) -> Path:
    """The archive's slides (the corrupt one included) under Unicode names."""
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(archive / "good.svs", folder / "Präparat 東京 🧫 №1.svs")
    shutil.copy(archive / "bad.svs", folder / "βλάβη — ø.svs")
    return folder


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize("options", [{"context": [(1.0, 64)]}, {"decode": "device"}])
def test_every_field_matches_torch_transport_with_unicode_slide_names(
    archive: Path, tmp_path: Path, start: str, options: dict[str, Any]
) -> None:
    """Every field of every batch (dtypes, shapes and strides too; the compressed tiles, slide
    paths and fingerprints of ``decode="device"``, the context tiles and boxes) and the
    quarantine records are those of torch's transport, with slides named in any script."""
    slides = _unicode_archive(archive, tmp_path, "named-slides")
    indexes = [
        build_index(
            [slides],
            tmp_path / f"idx{k}",
            tile_size=256,
            level=0,
            min_tissue=0.0,
        )
        for k in range(2)
    ]
    assert "東京" in indexes[0].slides[0].path + indexes[0].slides[1].path
    seen = []
    for way, index in zip(("ring", "torch"), indexes, strict=True):
        loader = _loader(index, start, ring=way == "ring", **options)
        batches = []
        for batch in loader:
            assert _in_ring(loader, batch.images) == (way == "ring")
            batches.append(_fields(batch))
        assert loader.ring_fallbacks == 0
        seen.append(batches)
    ring, plain = seen
    assert len(ring) == len(plain) > 0
    for a, b in zip(ring, plain, strict=True):
        for name in a:
            if name == "quarantine" and a[name] is not None:  # each index has its own
                a[name], b[name] = a[name].replace("idx0", "idx"), b[name].replace("idx1", "idx")
            assert _equal(a[name], b[name]), name
    if "decode" in options:
        assert any(b["encoded"] for b in ring) and any(
            "東京" in str(b["slide_paths"]) for b in ring
        )
    else:
        assert all(b["context_inside"] is not None for b in ring)
        assert _records(indexes[0]) != []  # (compressed tiles fail later, on decode)
    assert any(not bool(b["ok"][3].all()) for b in ring)  # the corrupt tiles came through
    assert _records(indexes[0]) == _records(indexes[1])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_kept_columns_do_not_keep_slots(index: SlideIndex, context: str) -> None:
    """A loop that keeps every batch's per-tile columns (not its pixels) holds no slot: the
    columns are the consumer's own writable memory, and no batch falls back."""
    loader = _loader(index, context)
    kept = []
    for _ in range(3):
        for batch in loader:
            assert _in_ring(loader, batch.images)
            kept.append((batch.rows, batch.x, batch.y, batch.ok, batch.slide_id))
            del batch
    assert loader.ring_fallbacks == 0
    ds = TileDataset(index, record_failures=False)
    for rows, x, y, ok, slide_id in kept:
        assert not _in_ring(loader, x) and not _in_ring(loader, ok)
        expected = ds.read_batch(rows.tolist())
        assert torch.equal(x, expected.x) and torch.equal(y, expected.y)
        assert torch.equal(slide_id, expected.slide_id)
        x.add_(1)  # writable, without a warning (warnings are errors here)


def test_packed_columns_round_trip() -> None:
    """Any dtype and shape (coverage, context boxes, empty batches), None and device-less
    fields left alone, each column a writable tensor of its own."""
    state: dict[str, Any] = {
        "ok": torch.tensor([True, False, True]),
        "x": torch.tensor([1, -(2**62), 3]),
        "coverage": torch.rand(3, 5),
        "context_inside": torch.arange(24, dtype=torch.int32).view(3, 2, 4),
        "empty": torch.zeros(0, 4, dtype=torch.int16),
        "label": torch.arange(6)[::2],  # not contiguous
        "slide_label": None,
    }
    expected = {k: v.clone() for k, v in state.items() if v is not None}
    data, layout = pack_columns(state, tuple(state))
    assert all(state[k] is None for k in expected)
    columns = unpack_columns(*pickle.loads(pickle.dumps((data, layout))))
    assert set(columns) == set(expected)
    for name, tensor in expected.items():
        assert columns[name].dtype == tensor.dtype and columns[name].is_contiguous()
        assert torch.equal(columns[name], tensor), name
    columns["x"][0] = 7
    assert columns["ok"].tolist() == [True, False, True]  # the columns do not overlap
