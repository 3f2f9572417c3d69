"""Nothing the user asks for is silently ignored: transforms run, every option is validated,
options given with an opened index or a sampler are honoured or refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from wsi_loader import (
    ConfigError,
    DistributedTileSampler,
    SlideBagDataset,
    SlideIndex,
    TileBatch,
    TileDataset,
    build_index,
    make_loader,
)


def flip(image: torch.Tensor) -> torch.Tensor:
    return image.flip(-1)


def mark_batch(batch: TileBatch) -> TileBatch:
    batch.images = batch.images[:, :16, :16].float() / 255
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_make_loader_applies_the_tile_transform_in_its_workers(
    index: SlideIndex, workers: int
) -> None:
    plain = TileDataset(index)
    loader = make_loader(
        index,
        batch_size=8,
        num_workers=workers,
        shuffle=False,
        transform=flip,
        multiprocessing_context="spawn" if workers else None,
    )
    batch = next(iter(loader))
    rows = batch.rows.numpy()
    expected = plain.reader.read(rows).pixels[:, :, ::-1]  # flipped along W in NHWC
    np.testing.assert_array_equal(batch.images.numpy(), expected)
    assert not np.array_equal(expected, plain.reader.read(rows).pixels)  # the flip shows


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_transform_runs_in_the_reading_process(index: SlideIndex, workers: int) -> None:
    loader = make_loader(
        index, batch_size=8, num_workers=workers, shuffle=False, batch_transform=mark_batch
    )
    batch = next(iter(loader))
    assert batch.images.dtype == torch.float32 and batch.images.shape == (8, 16, 16, 3)
    assert not batch.recycled


def test_a_tile_transform_that_changes_the_shape_is_a_clear_error_in_batches(
    index: SlideIndex,
) -> None:
    ds = TileDataset(index, transform=lambda img: img[:, :8, :8])
    assert ds[0]["image"].shape == (3, 8, 8)  # per item: anything goes
    with pytest.raises(ConfigError, match="uint8 tensor of shape"):
        ds.read_batch([0, 1])


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_open_slides", 2.5),
        ("fill_value", 3.7),
        ("retries", 2.5),
        ("retries", -1),
        ("on_error", "ignore"),
        ("decode_threads", 0),
        ("split", 3),
        ("missing_slides", "skip"),
        ("unlabelled", "ignore"),
        ("layout_cache_mb", "64"),
        ("record_failures", "yes"),
        ("transform", "flip"),
    ],
)
def test_every_dataset_option_is_validated(index: SlideIndex, option: str, value: object) -> None:
    for build in (
        lambda: TileDataset(index, **{option: value}),
        lambda: make_loader(index, num_workers=0, **{option: value}),
    ):
        with pytest.raises(ConfigError) as caught:
            build()
        assert caught.value.key == option
    if option != "transform":
        with pytest.raises(ConfigError) as caught:
            SlideBagDataset(index, **{option: value})
        assert caught.value.key == option


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("batch_size", 0),
        ("batch_size", 2.0),
        ("num_workers", -1),
        ("prefetch_factor", 0),
        ("decode", "gpu"),
        ("multiprocessing_context", "threads"),
        ("drop_last", "no"),
    ],
)
def test_every_loader_option_is_validated(index: SlideIndex, option: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        make_loader(index, **{option: value})  # type: ignore[arg-type]
    assert caught.value.key == option


def test_a_misspelt_keyword_names_the_function_and_the_close_key(index: SlideIndex) -> None:
    """make_loader passes unknown keywords on to TileDataset, whose TypeError named
    TileDataset.__init__ and nothing close: a typo of make_loader's own option (batch_sise)
    sent users to the wrong function."""
    for call, name, typo, meant in (
        (lambda: make_loader(index, batch_sise=32), "make_loader", "batch_sise", "batch_size"),
        (lambda: make_loader(index, on_eror="raise"), "make_loader", "on_eror", "on_error"),
        (lambda: SlideBagDataset(index, chunksize=8), "SlideBagDataset", "chunksize", "chunk_size"),
        (lambda: SlideBagDataset(index, retires=1), "SlideBagDataset", "retires", "retries"),
    ):
        with pytest.raises(TypeError) as caught:
            call()
        message = str(caught.value)
        assert message.startswith(f"{name}() got an unexpected keyword argument {typo!r}")
        assert f"did you mean {meant!r}?" in message and "TileDataset" not in message
    with pytest.raises(TypeError, match=r"argument 'zzz'$"):  # nothing close: no guess
        make_loader(index, zzz=1)


def test_bag_options_are_validated(index: SlideIndex) -> None:
    for kwargs, key in (
        ({"k": 2.5}, "k"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"seed": "1"}, "seed"),
    ):
        with pytest.raises(ConfigError) as caught:
            SlideBagDataset(index, **kwargs)  # type: ignore[arg-type]
        assert caught.value.key == key


def test_shuffle_or_seed_with_a_sampler_is_an_error(index: SlideIndex) -> None:
    ds = TileDataset(index)
    sampler = DistributedTileSampler(ds, shuffle=False)
    for extra in ({"shuffle": True}, {"seed": 3}, {"shuffle": False}):
        with pytest.raises(ConfigError, match="own sampler"):
            make_loader(ds, sampler=sampler, **extra)  # type: ignore[arg-type]
    assert len(make_loader(ds, sampler=sampler, batch_size=4, num_workers=0)) > 0
    with pytest.raises(ConfigError, match="dataset options"):
        make_loader(ds, on_error="raise")


def test_options_given_with_an_opened_index_are_honoured(archive: Path, tmp_path: Path) -> None:
    index = build_index(
        [archive], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0, root=str(archive)
    )
    ds = TileDataset(index)
    ds.reader.read(np.arange(len(index)))  # quarantines the corrupt tiles
    bad = len(index.quarantine.read())
    assert bad == 4
    assert len(TileDataset(index, exclude_quarantined=True)) == len(index) - bad
    moved = tmp_path / "moved"
    archive.rename(moved)
    assert TileDataset(index, root=str(moved)).index.root == str(moved)
    assert TileDataset(index, root=str(moved))[0]["ok"]


def test_bag_epochs_reach_persistent_workers(index: SlideIndex) -> None:
    bags = SlideBagDataset(index, k=4, seed=1)
    loader = torch.utils.data.DataLoader(
        bags, batch_size=None, num_workers=1, persistent_workers=True, shuffle=False
    )
    drawn = []
    for epoch in range(3):
        bags.set_epoch(epoch)
        drawn.append(tuple(next(iter(loader))["rows"].tolist()))
    assert len(set(drawn)) == 3
    again = SlideBagDataset(index, k=4, seed=1)
    again.set_epoch(2)
    assert drawn[2] == tuple(again[0]["rows"].tolist())
