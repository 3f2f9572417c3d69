from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import openslide
import pytest

from tests.conftest import corrupt_rows
from wsi_loader.dataset import TileReader
from wsi_loader.errors import TileReadError
from wsi_loader.index import SlideIndex, build_index


def openslide_pixels(index: SlideIndex, row: int) -> np.ndarray:
    cols = index.columns
    slide = openslide.OpenSlide(index.slide_path(int(cols["slide_id"][row])))
    size = int(cols["read_size"][row])
    region = slide.read_region(
        (int(cols["l0_x"][row]), int(cols["l0_y"][row])), int(cols["level"][row]), (size, size)
    )
    slide.close()
    return np.asarray(region)[..., :3]


def test_good_tiles_match_openslide_and_bad_ones_are_filled(index: SlideIndex) -> None:
    bad = corrupt_rows(index)
    assert len(bad) == 4
    neighbours = np.concatenate([bad - 1, bad + 1, [0, len(index) - 1]])
    neighbours = np.setdiff1d(neighbours, bad)
    reader = TileReader(index, on_error="fill", fill_value=7)
    result = reader.read(np.concatenate([bad, neighbours]))
    assert result.ok.tolist() == [False] * 4 + [True] * len(neighbours)
    assert (result.pixels[:4] == 7).all()
    assert all("marker" in (e or "") for e in result.errors[:4])
    for i, row in enumerate(neighbours.tolist(), start=4):
        np.testing.assert_array_equal(result.pixels[i], openslide_pixels(index, row))
    records = index.quarantine.read()
    assert sorted(r["row"] for r in records) == sorted(bad.tolist())
    assert {"slide_id", "x", "y", "error", "path"} <= records[0].keys()


def test_retries_are_bounded_and_reopen(index: SlideIndex) -> None:
    row = int(corrupt_rows(index)[0])
    reader = TileReader(index, retries=3, record_failures=False)
    before = reader.pool.opened
    assert not reader.read([row]).ok[0]
    assert reader.pool.opened - before == 4  # first try + 3 retries, each on a fresh handle
    good = int(np.setdiff1d(np.arange(len(index)), corrupt_rows(index))[-1])
    assert reader.read([good]).ok[0]


def test_substitute_reads_a_deterministic_tile_of_the_same_slide(index: SlideIndex) -> None:
    row = int(corrupt_rows(index)[0])
    reader = TileReader(index, on_error="substitute", record_failures=False)
    first = reader.read([row])
    again = TileReader(index, on_error="substitute", record_failures=False).read([row])
    assert not first.ok[0] and first.substituted[0]
    source = int(first.source_rows[0])
    assert source != row and source == int(again.source_rows[0])
    assert index.columns["slide_id"][source] == index.columns["slide_id"][row]
    np.testing.assert_array_equal(first.pixels[0], openslide_pixels(index, source))


def test_raise_policy_raises_structured_error(index: SlideIndex) -> None:
    row = int(corrupt_rows(index)[0])
    with pytest.raises(TileReadError) as info:
        TileReader(index, on_error="raise", retries=0).read([row])
    err = info.value
    assert err.path and err.path.endswith("bad.svs")
    assert (err.l0_x, err.l0_y, err.level) == (
        int(index.columns["l0_x"][row]),
        int(index.columns["l0_y"][row]),
        0,
    )
    assert "marker" in (err.cause or "")
    assert index.quarantine.read()[0]["row"] == row  # recorded before raising


def test_vanished_and_truncated_slides_are_failures(index: SlideIndex, archive: Path) -> None:
    good_id = next(i for i, s in enumerate(index.slides) if s.path.endswith("good.svs"))
    bad_id = 1 - good_id
    rows_good = np.flatnonzero(index.columns["slide_id"] == good_id)[:3]
    rows_bad = np.flatnonzero(index.columns["slide_id"] == bad_id)[:2]
    reader = TileReader(index, retries=1)
    assert reader.read(rows_good).ok.all()
    os.remove(archive / "good.svs")  # deleted mid-epoch
    with open(archive / "bad.svs", "r+b") as fh:  # truncated mid-epoch
        fh.truncate(4096)
    reader.pool.close()
    result = reader.read(np.concatenate([rows_good, rows_bad]))
    assert not result.ok.any()
    assert "does not exist" in (result.errors[0] or "")


def test_unreadable_svs_from_testdata(testdata: Path, tmp_path: Path) -> None:
    index = build_index(
        [testdata / "unreadable.svs"], tmp_path / "idx", level=0, tile_size=16, min_tissue=0
    )
    assert len(index) == 1
    for policy in ("fill", "substitute"):
        result = TileReader(index, on_error=policy).read([0])
        assert not result.ok[0] and not result.substituted[0]  # no other tile to substitute
        assert "Bogus marker length" in (result.errors[0] or "")
        assert (result.pixels == 255).all()


def test_off_level_reads_are_resized_to_tile_size(archive: Path, tmp_path: Path) -> None:
    index = build_index(
        [archive / "good.svs"], tmp_path / "idx", tile_size=128, mpp=1.0, min_tissue=0
    )
    assert index.slides[0].read_size == 256 and index.slides[0].read_level == 0
    result = TileReader(index).read([0, 1])
    assert result.pixels.shape == (2, 128, 128, 3) and result.ok.all()


def test_option_checks(index: SlideIndex) -> None:
    with pytest.raises(ValueError, match="on_error must be one of"):
        TileReader(index, on_error="ignore")
    with pytest.raises(ValueError, match="retries"):
        TileReader(index, retries=-1)
    with pytest.raises(IndexError):
        TileReader(index).read([len(index)])
