from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from wsi_loader.dataset import BalancedTileSampler, DistributedTileSampler, TileDataset
from wsi_loader.dataset._samplers import RandomPermutation
from wsi_loader.index import SlideIndex


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection(n: int) -> None:
    perm = RandomPermutation(n, 3, 1)(np.arange(n))
    assert sorted(perm.tolist()) == list(range(n))
    if n > 10:
        assert perm.tolist() != list(range(n))


@pytest.mark.parametrize(("n", "world"), [(10, 3), (2, 4), (100, 1), (1001, 8)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_are_disjoint_and_cover(n: int, world: int, drop_last: bool) -> None:
    shards = [
        list(DistributedTileSampler(Sized(n), world, r, seed=5, drop_last=drop_last))
        for r in range(world)
    ]
    assert len({len(s) for s in shards}) == 1
    flat = [i for s in shards for i in s]
    if drop_last:
        assert len(set(flat)) == len(flat) == (n // world) * world
    else:
        assert set(flat) == set(range(n))
        assert len(flat) - n < world  # padding smaller than the world size
        if n >= world:
            assert len(flat) - len(set(flat)) == len(flat) - n


def test_unshuffled_order_matches_torch() -> None:
    for rank in range(3):
        ours = list(DistributedTileSampler(Sized(11), 3, rank, shuffle=False))
        theirs = list(DistributedSampler(Sized(11), 3, rank, shuffle=False))  # type: ignore[arg-type]
        assert ours == theirs


def test_deterministic_per_seed_and_epoch() -> None:
    a = DistributedTileSampler(Sized(500), 2, 0, seed=1)
    b = DistributedTileSampler(Sized(500), 2, 0, seed=1)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    assert list(a) != list(DistributedTileSampler(Sized(500), 2, 0, seed=2))


def test_resume_mid_epoch() -> None:
    sampler = DistributedTileSampler(Sized(300), 2, 1, seed=4)
    sampler.set_epoch(3)
    full = list(sampler)
    it = iter(sampler)
    head = [next(it) for _ in range(40)]
    state = sampler.state_dict()
    assert state == {
        "epoch": 3,
        "seed": 4,
        "position": 40,
        "num_replicas": 2,
        "rank": 1,
        "length": 150,
    }
    fresh = DistributedTileSampler(Sized(300), 2, 1, seed=4)
    fresh.load_state_dict(state)
    assert head + list(fresh) == full
    assert len(list(fresh)) == len(full)  # the resume applies to one epoch only
    with pytest.raises(ValueError, match="seed"):
        DistributedTileSampler(Sized(300), seed=9).load_state_dict(state)


def test_huge_index_needs_no_permutation_array() -> None:
    tracemalloc.start()
    sampler = DistributedTileSampler(Sized(10**9), 4, 2, seed=0)
    it = iter(sampler)
    head = [next(it) for _ in range(1000)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 16 * 2**20
    assert len(set(head)) == 1000 and max(head) < 10**9


def test_slide_window_keeps_locality(index: SlideIndex) -> None:
    ds = TileDataset(index)
    sampler = DistributedTileSampler(ds, 1, 0, seed=3, slide_window=1)
    rows = np.array(list(sampler))
    assert sorted(rows.tolist()) == list(range(len(ds)))
    slides = index.columns["slide_id"][rows]
    assert int((np.diff(slides) != 0).sum()) == 1  # one slide after the other
    assert rows.tolist() != sorted(rows.tolist())  # but shuffled within the slide
    two = [list(DistributedTileSampler(ds, 2, r, seed=3, slide_window=1)) for r in range(2)]
    assert sorted(two[0] + two[1])[: len(ds)] == list(range(len(ds)))


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="rank must be in"):
        DistributedTileSampler(Sized(5), 2, 2)
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedTileSampler(Sized(5), 0, 0)
    with pytest.raises(ValueError, match="slide_window"):
        DistributedTileSampler(Sized(5), slide_window=0)
    with pytest.raises(ValueError, match="needs a dataset with a SlideIndex"):
        DistributedTileSampler(Sized(5), slide_window=2)


def test_balanced_by_slide_and_label(index: SlideIndex) -> None:
    ds = TileDataset(index)
    rows = np.array(list(BalancedTileSampler(ds, by="slide", num_samples=4000, seed=1)))
    counts = np.bincount(index.columns["slide_id"][rows], minlength=2)
    assert abs(counts[0] - counts[1]) < 300
    by_label = BalancedTileSampler(ds, by="label", num_samples=4000, seed=1, num_replicas=2, rank=1)
    assert len(by_label) == 2000
    labels = ds.slide_labels[index.columns["slide_id"][np.array(list(by_label))]]
    assert set(labels.tolist()) == {0, 1}
    with pytest.raises(ValueError, match="by must be"):
        BalancedTileSampler(ds, by="stain")  # type: ignore[arg-type]


TORCHRUN_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from wsi_loader.dataset import DistributedTileSampler

class Sized:
    def __len__(self):
        return 1001

dist.init_process_group("gloo")
sampler = DistributedTileSampler(Sized(), seed=7)  # world size and rank from torch.distributed
sampler.set_epoch(2)
rows = list(sampler)
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, rows)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as fh:
        json.dump({"world": dist.get_world_size(), "shards": gathered}, fh)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_torchrun_two_ranks_gloo(tmp_path: Path) -> None:
    script = tmp_path / "shard.py"
    script.write_text(TORCHRUN_SCRIPT)
    out = tmp_path / "shards.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(out),
        ],
        check=True,
        env=env,
        timeout=180,
        capture_output=True,
    )

    result = json.loads(out.read_text())
    a, b = result["shards"]
    assert result["world"] == 2 and len(a) == len(b) == 501
    assert set(a) | set(b) == set(range(1001)) and len(set(a) & set(b)) == 1  # one pad sample
    assert a == _epoch(DistributedTileSampler(Sized(1001), 2, 0, seed=7), 2)


def _epoch(sampler: DistributedTileSampler, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_negative_seeds_do_not_collide_and_positive_seeds_keep_their_order() -> None:
    orders = {
        seed: list(DistributedTileSampler(Sized(500), num_replicas=1, rank=0, seed=seed))
        for seed in (-1, 1, 0)
    }
    assert orders[-1] != orders[1]
    # non-negative seeds give the permutation they always gave (entropy [seed, epoch])
    legacy = RandomPermutation.__new__(RandomPermutation)
    legacy.__init__(500, 1, 0)  # type: ignore[misc]
    state = np.random.SeedSequence([1, 0]).generate_state(4, np.uint64)
    assert [int(k) for k in legacy.keys] == [int(k) for k in state]
    assert orders[1] == legacy(np.arange(500, dtype=np.int64)).tolist()
    balanced = [
        list(BalancedTileSampler(_TwoLabelDataset(), num_samples=50, seed=s)) for s in (-1, 1)
    ]
    assert balanced[0] != balanced[1]


def test_state_dict_refuses_another_world_rank_or_length() -> None:
    saved = DistributedTileSampler(Sized(100), num_replicas=2, rank=0, seed=3)
    state = saved.state_dict(consumed=10)
    assert {k: state[k] for k in ("num_replicas", "rank", "length")} == {
        "num_replicas": 2,
        "rank": 0,
        "length": 50,
    }
    for other, message in (
        (DistributedTileSampler(Sized(100), num_replicas=4, rank=0, seed=3), "num_replicas"),
        (DistributedTileSampler(Sized(100), num_replicas=2, rank=1, seed=3), "rank"),
        (DistributedTileSampler(Sized(120), num_replicas=2, rank=0, seed=3), "length"),
        (DistributedTileSampler(Sized(100), num_replicas=2, rank=0, seed=4), "seed"),
    ):
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(state)
    same = DistributedTileSampler(Sized(100), num_replicas=2, rank=0, seed=3)
    same.load_state_dict(state)
    assert list(same) == list(saved)[10:]


class _TwoLabelDataset:
    """Three slides of 10, 10 and 40 tiles; the first two labelled 0, the third 1."""

    def __init__(self) -> None:
        from wsi_loader.index._table import SlideIndex
        from wsi_loader.index._table_files import SlideRecord

        counts = [10, 10, 40]
        slide_id = np.repeat(np.arange(3), counts).astype(np.int32)
        zeros = np.zeros(len(slide_id))
        columns = {
            "slide_id": slide_id,
            "l0_x": zeros.astype(np.int32),
            "l0_y": zeros.astype(np.int32),
            "level": zeros.astype(np.int16),
            "read_size": zeros.astype(np.int32),
            "tissue": zeros.astype(np.float32),
        }
        slides = tuple(
            SlideRecord(path=f"s{i}.svs", label=label, tiles=n)
            for i, (label, n) in enumerate(zip(["a", "a", "b"], counts, strict=True))
        )
        meta = {"schema_version": 1, "generation": "gen-000001", "params": {"tile_size": 8}}
        self.index = SlideIndex(
            path=Path("."), meta=meta, slides=slides, columns=columns, label_names=("a", "b")
        )

    def __len__(self) -> int:
        return 60


def test_balanced_by_label_draws_labels_not_slides_equally() -> None:
    ds = _TwoLabelDataset()
    rows = np.array(list(BalancedTileSampler(ds, by="label", num_samples=6000, seed=2)))
    labels = ds.index.slide_labels()[ds.index.columns["slide_id"][rows]]
    share_b = float((labels == 1).mean())
    assert 0.46 < share_b < 0.54  # by slide it would be 1/3
    by_slide = np.array(list(BalancedTileSampler(ds, by="slide", num_samples=6000, seed=2)))
    slide_share = np.bincount(ds.index.columns["slide_id"][by_slide], minlength=3) / 6000
    assert np.all(np.abs(slide_share - 1 / 3) < 0.04)


class _TileLabelDataset:
    """An index labelled from annotations: two slides of 6 tiles whose tiles are of three
    classes, 8 / 3 / 1 tiles in all, while both slides have the same (slide) label."""

    tile_label = np.array([0, 0, 1, 0, 0, 0, 2, 0, 1, 0, 1, 0], dtype=np.int32)

    def __init__(self) -> None:
        from wsi_loader.index._table import SlideIndex
        from wsi_loader.index._table_files import SlideRecord

        slide_id = np.repeat(np.arange(2), 6).astype(np.int32)
        zeros = np.zeros(len(slide_id))
        columns = {
            "slide_id": slide_id,
            "l0_x": zeros.astype(np.int32),
            "l0_y": zeros.astype(np.int32),
            "level": zeros.astype(np.int16),
            "read_size": zeros.astype(np.int32),
            "tissue": zeros.astype(np.float32),
            "tile_label": self.tile_label,
        }
        slides = tuple(SlideRecord(path=f"s{i}.svs", label="case", tiles=6) for i in range(2))
        meta = {"schema_version": 1, "generation": "gen-000001", "params": {"tile_size": 8}}
        self.index = SlideIndex(
            path=Path("."),
            meta=meta,
            slides=slides,
            columns=columns,
            label_names=("stroma", "tumour", "necrosis"),
            slide_label_names=("case",),
        )

    def __len__(self) -> int:
        return len(self.tile_label)


def test_balanced_by_label_draws_tile_labels_equally() -> None:
    """On an index labelled from annotations the labels are the tiles' classes: 8 / 3 / 1
    tiles are drawn a third each (it drew 0.67 / 0.25 / 0.09 by slide labels), and every
    tile of a class equally often."""
    ds = _TileLabelDataset()
    rows = np.array(list(BalancedTileSampler(ds, by="label", num_samples=12000, seed=2)))
    shares = np.bincount(ds.tile_label[rows], minlength=3) / len(rows)
    assert np.all(np.abs(shares - 1 / 3) < 0.03), shares
    per_tile = np.bincount(rows, minlength=len(ds)) / len(rows)
    stroma = np.flatnonzero(ds.tile_label == 0)
    assert np.all(np.abs(per_tile[stroma] - 1 / 3 / 8) < 0.015)
    # the same draws for the same seed and epoch, others for another epoch; resumable
    sampler = BalancedTileSampler(ds, by="label", num_samples=100, seed=2)
    first = list(sampler)
    assert list(BalancedTileSampler(ds, by="label", num_samples=100, seed=2)) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.load_state_dict({"epoch": 0, "position": 40, "seed": 2})
    assert list(sampler) == first[40:]
