from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import corrupt_rows
from wsi_loader.dataset import SlideBagDataset, TileDataset
from wsi_loader.index import SlideIndex


def test_k_tiles_per_slide_deterministic_per_epoch(index: SlideIndex) -> None:
    bags = SlideBagDataset(index, k=6, seed=2)
    assert len(bags) == 2
    bag = bags[0]
    assert bag["images"].shape == (6, 3, 256, 256) and bag["images"].dtype == torch.uint8
    assert bag["ok"].shape == bag["x"].shape == bag["rows"].shape == (6,)
    assert bags.label_names[bag["label"]] == index.slides[bag["slide_id"]].label
    assert set(index.columns["slide_id"][bag["rows"].numpy()].tolist()) == {bag["slide_id"]}
    assert torch.equal(bags[0]["rows"], bag["rows"])
    bags.set_epoch(1)
    assert not torch.equal(bags[0]["rows"], bag["rows"])
    tiles = TileDataset(index)
    row = int(bag["rows"][2])
    assert torch.equal(bag["images"][2], tiles[row]["image"])


def test_all_tiles_in_chunks_cover_every_row_once(index: SlideIndex) -> None:
    bags = SlideBagDataset(index, k=None, chunk_size=13)
    rows = torch.cat([bags[i]["rows"] for i in range(len(bags))]).tolist()
    assert sorted(rows) == list(range(len(index)))
    assert all(bags[i]["images"].shape[0] <= 13 for i in range(len(bags)))


def test_bags_report_failures_and_work_in_workers(index: SlideIndex) -> None:
    bad = set(corrupt_rows(index).tolist())
    bags = SlideBagDataset(index, k=None, chunk_size=1000)
    loader = DataLoader(bags, batch_size=1, num_workers=2, multiprocessing_context="spawn")
    failed = set()
    for item in loader:
        failed |= set(item["rows"][0][~item["ok"][0]].tolist())
    assert failed == bad


def test_short_slides_are_sampled_with_replacement(index: SlideIndex) -> None:
    big_k = int(np.diff(np.searchsorted(index.columns["slide_id"], [0, 1, 2])).max()) + 5
    bag = SlideBagDataset(index, k=big_k)[0]
    assert bag["images"].shape[0] == big_k


def test_option_checks(index: SlideIndex) -> None:
    with pytest.raises(ValueError, match="'k'"):
        SlideBagDataset(index, k=0)
    with pytest.raises(ValueError, match="chunk_size"):
        SlideBagDataset(index, k=None, chunk_size=0)
    with pytest.raises(IndexError):
        SlideBagDataset(index, k=2)[5]
