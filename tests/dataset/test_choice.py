"""What `make_loader(num_workers="auto")` reads with (`wsi_loader.dataset._choice`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from wsi_loader.dataset import TileBatch, TileDataset, make_loader
from wsi_loader.dataset._choice import MAX_THREADED_CORES, MAX_WORKERS, choose_readers
from wsi_loader.dataset._cores import usable_cores
from wsi_loader.index import SlideIndex, build_index


def _flip(images: torch.Tensor) -> torch.Tensor:
    return images.flip(-1)


def _same(batch: TileBatch) -> TileBatch:
    return batch


def test_few_cores_and_plain_reads_get_threads(index: SlideIndex) -> None:
    tiles = TileDataset(index)
    for cores in range(1, MAX_THREADED_CORES + 1):
        choice = choose_readers(tiles, "auto", cores=cores)
        assert (choice.kind, choice.workers, choice.threads) == ("threads", 0, cores)
    assert choose_readers(tiles, None, cores=2).kind == "threads"  # None reads as "auto"


def test_many_cores_get_one_worker_per_core_at_most_eight(index: SlideIndex) -> None:
    tiles = TileDataset(index)
    choice = choose_readers(tiles, "auto", cores=MAX_THREADED_CORES + 1)
    assert (choice.kind, choice.workers) == ("processes", MAX_THREADED_CORES + 1)
    assert "usable cores" in choice.reason
    assert choose_readers(tiles, "auto", cores=64).workers == MAX_WORKERS


def test_an_explicit_number_wins(index: SlideIndex) -> None:
    tiles = TileDataset(index, transform=_flip)
    assert choose_readers(tiles, 0, cores=2)[:2] == ("main", 0)
    assert choose_readers(tiles, 3, cores=2)[:2] == ("processes", 3)
    assert choose_readers(TileDataset(index), 1, cores=16)[:2] == ("processes", 1)


@pytest.mark.parametrize(
    ("dataset_options", "loader_options", "said"),
    [
        ({"transform": _flip}, {}, "transform runs in Python"),
        ({"transform": _flip, "batch_transform": _same}, {}, "transform and batch_transform"),
        ({"backend": "openslide"}, {}, "OpenSlide"),
        ({}, {"timeout": 30.0}, "timeout=30.0"),
        ({}, {"multiprocessing_context": "spawn"}, "multiprocessing_context='spawn'"),
    ],
)
def test_reads_that_hold_the_gil_or_need_a_process_get_processes(
    index: SlideIndex,
    dataset_options: dict[str, object],
    loader_options: dict[str, object],
    said: str,
) -> None:
    tiles = TileDataset(index, **dataset_options)  # type: ignore[arg-type]
    choice = choose_readers(tiles, "auto", cores=2, **loader_options)  # type: ignore[arg-type]
    assert (choice.kind, choice.workers) == ("processes", 2)
    assert said in choice.reason


def test_slides_indexed_by_openslide_get_processes(testdata: Path, tmp_path: Path) -> None:
    index = build_index([testdata / "dicom-boxes"], tmp_path / "idx", tile_size=16, level=0)
    assert index.slides[0].backend == "openslide"  # DICOM: no TIFF for the raw reader
    choice = choose_readers(TileDataset(index), "auto", cores=2)
    assert choice.kind == "processes" and "OpenSlide" in choice.reason


def test_make_loader_says_what_it_chose(
    index: SlideIndex, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="wsi_loader.dataset._loader"):
        loader = make_loader(index, batch_size=16)
    expected = choose_readers(TileDataset(index), "auto", cores=usable_cores())
    assert loader.readers == expected
    assert loader.num_workers == expected.workers
    assert "num_workers='auto'" in caplog.text and expected.reason in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="wsi_loader.dataset._loader"):
        make_loader(index, batch_size=16, num_workers=0)
    assert "num_workers='auto'" not in caplog.text  # a number given is not a choice made


def test_timeout_with_auto_starts_workers(index: SlideIndex) -> None:
    loader = make_loader(index, batch_size=16, timeout=60.0, persistent_workers=False)
    assert loader.readers is not None and loader.readers.kind == "processes"
    assert loader.num_workers >= 1 and loader.timeout == 60.0
    assert sum(len(batch) for batch in loader) == len(index)
