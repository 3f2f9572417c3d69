from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import SlideFactory, corrupt_rows
from wsi_loader.dataset import TileBatch, TileDataset, make_loader
from wsi_loader.errors import ConfigError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index._quarantine import Quarantine


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_make_loader_yields_whole_batches(
    index: SlideIndex, workers: int, context: str | None
) -> None:
    loader = make_loader(
        index, batch_size=16, num_workers=workers, multiprocessing_context=context, seed=3
    )
    ds = TileDataset(index)
    rows, bad = [], []
    for batch in loader:
        assert isinstance(batch, TileBatch)
        assert batch.images.dtype == torch.uint8 and batch.images.shape[1:] == (256, 256, 3)
        assert batch.images.is_contiguous()
        rows += batch.rows.tolist()
        bad += batch.rows[~batch.ok].tolist()
    assert sorted(rows) == list(range(len(index)))
    assert sorted(bad) == sorted(corrupt_rows(index).tolist())
    first = next(iter(loader))
    for i in (0, len(first) - 1):
        sample = ds[int(first.rows[i])]
        assert torch.equal(first.images[i].permute(2, 0, 1), sample["image"])
        assert int(first.label[i]) == sample["label"]
        assert (int(first.x[i]), int(first.y[i])) == (sample["x"], sample["y"])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_with_decode_threads_read_what_one_thread_reads(
    index: SlideIndex, context: str
) -> None:
    """Threads inside a worker, after the parent itself read with threads (and forked)."""
    rows = list(range(len(index)))
    parent = TileDataset(index, decode_threads=3, record_failures=False)
    parent.read_batch(rows[:32])
    loader = make_loader(
        parent, batch_size=32, sampler=rows, num_workers=1, multiprocessing_context=context
    )
    one = TileDataset(index, decode_threads=1, record_failures=False)
    for batch in loader:
        expected = one.read_batch(batch.rows.tolist())
        assert torch.equal(batch.images, expected.images)
        assert torch.equal(batch.ok, expected.ok)


def test_encoded_reads_decode_to_the_same_pixels(index: SlideIndex) -> None:
    from wsi_loader.device._loader import decode_encoded

    ds = TileDataset(index)
    rows = list(range(0, len(index), 7))
    plain = ds.read_batch(rows)
    packed = ds.read_batch(rows, encoded=True)
    assert packed.encoded is not None and all(e is not None for e in packed.encoded)
    assert int(packed.images.sum()) == 0  # nothing decoded in the worker
    decoded = decode_encoded(packed, torch.device("cpu"))
    assert torch.equal(decoded.images, plain.images)


def test_corrupt_encoded_tile_is_caught_after_the_worker(index: SlideIndex) -> None:
    from wsi_loader.device._loader import decode_encoded

    row = int(corrupt_rows(index)[0])
    batch = TileDataset(index).read_batch([row, 0], encoded=True)
    assert batch.encoded is not None and batch.encoded[0] is not None  # bytes read fine
    decode_encoded(batch, torch.device("cpu"))
    assert batch.ok.tolist() == [False, True]
    assert bool((batch.images[0] == 255).all())
    assert [r["row"] for r in index.quarantine.read()] == [row]
    # the next epochs decode it again in the same (main) process: recorded once, not per epoch
    quarantines: dict[str, Quarantine] = {}
    for _ in range(2):
        again = TileDataset(index).read_batch([row, 0], encoded=True)
        decode_encoded(again, torch.device("cpu"), quarantines=quarantines)
        assert again.ok.tolist() == [False, True]
    assert [r["row"] for r in index.quarantine.read()] == [row]


def test_off_level_dct_scaling_matches_openslide_resize(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """224 px at 0.5 um/px from a 0.25 um/px slide: DCT-scaled decode vs OpenSlide + resize."""
    import openslide
    from PIL import Image

    slide = make_slide(width=4096, height=3072, seed=41, mpp=0.25)
    index = build_index([slide], tmp_path / "idx", tile_size=128, mpp=0.5, min_tissue=0.5)
    assert index.slides[0].read_size == 256 and index.slides[0].read_level == 0
    ds = TileDataset(index)
    ref = openslide.OpenSlide(str(slide))
    diffs = []
    for row in range(0, len(index), max(1, len(index) // 10)):
        x, y = int(index.columns["l0_x"][row]), int(index.columns["l0_y"][row])
        region = ref.read_region((x, y), 0, (256, 256)).convert("RGB")
        expected = np.asarray(region.resize((128, 128), Image.Resampling.BILINEAR), dtype=np.int16)
        got = ds[row]["image"].permute(1, 2, 0).numpy().astype(np.int16)
        diffs.append(np.abs(got - expected).mean())
    ref.close()
    assert max(diffs) < 6.0  # different filters (DCT scaling vs bilinear); measured ~2-4


def test_option_checks(index: SlideIndex) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(index, batch_size=0)
    with pytest.raises(ValueError, match="decode"):
        make_loader(index, decode="gpu")
    with pytest.raises(ValueError, match="num_workers"):
        make_loader(index, num_workers=-1)
    with pytest.raises(ValueError, match="dataset options"):
        make_loader(TileDataset(index), on_error="raise")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_memory_batches(index: SlideIndex) -> None:
    loader = make_loader(index, batch_size=8, num_workers=2, pin_memory=True)
    batch = next(iter(loader))
    assert batch.images.is_pinned() and batch.ok.is_pinned()


def test_set_epoch_reshuffles(index: SlideIndex) -> None:
    loader = make_loader(index, batch_size=len(index), num_workers=0, seed=2)
    first = next(iter(loader)).rows.tolist()
    assert next(iter(loader)).rows.tolist() == first
    loader.set_epoch(1)
    second = next(iter(loader)).rows.tolist()
    assert second != first and sorted(second) == sorted(first)


def test_tile_batch_pickles_metadata_by_value(index: SlideIndex) -> None:
    import pickle

    batch = TileDataset(index).read_batch([0, 5, 9])
    clone = pickle.loads(pickle.dumps(batch))
    for name in ("images", "ok", "substituted", "rows", "slide_id", "x", "y", "label"):
        assert torch.equal(getattr(clone, name), getattr(batch, name)), name
    state = batch.__getstate__()
    assert isinstance(state["rows"], np.ndarray) and isinstance(state["images"], torch.Tensor)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_dataset_spawned_workers_cannot_receive_is_said_before_they_start(
    index: SlideIndex, context: str
) -> None:
    # a lambda (or a function of a notebook cell) works with fork; spawned workers got
    # "PicklingError: ... attribute lookup <lambda> on __main__ failed" from deep in torch,
    # after the loader started, with nothing saying which option to change
    ds = TileDataset(index, transform=lambda image: image)
    with pytest.raises(ConfigError, match=f"cannot be sent to '{context}' workers") as info:
        make_loader(ds, batch_size=8, num_workers=2, multiprocessing_context=context)
    message = str(info.value)
    assert "transform" in message and "lambda" in message and "module-level function" in message
    assert info.value.key == "multiprocessing_context"
    make_loader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")  # fine there
    make_loader(ds, batch_size=8, num_workers=0, multiprocessing_context=context)  # no workers


def test_make_loader_leaves_the_start_method_unset(index: SlideIndex) -> None:
    # multiprocessing.get_start_method() fixes the default as a side effect: a script that
    # made a loader first could no longer call set_start_method
    code = (
        "import multiprocessing, sys\n"
        "from wsi_loader import make_loader\n"
        "make_loader(sys.argv[1], batch_size=8, num_workers=2)\n"
        "multiprocessing.set_start_method('spawn')\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(index.path)], capture_output=True, text=True,
        check=False, timeout=120,
    )  # fmt: skip
    assert done.stdout.strip() == "ok", done.stderr
