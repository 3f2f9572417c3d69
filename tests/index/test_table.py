"""An index's files are checked against each other when it is opened: columns that lie about
slides, positions, levels or window sizes are an IndexFormatError naming the file, never
wrong tiles marked ok, an IndexError or a huge allocation."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from wsi_loader import IndexFormatError, SlideIndex, TileDataset, build_index


@pytest.fixture
def built(archive: Path, tmp_path: Path) -> Path:
    build_index([archive], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0)
    return tmp_path / "idx"


def _generation(index: Path) -> Path:
    return index / (index / "CURRENT").read_text().strip()


def _rewrite_column(index: Path, name: str, change: Callable[[np.ndarray], np.ndarray]) -> Path:
    file = _generation(index) / f"{name}.npy"
    column = np.load(file)
    np.save(file, change(column.copy()).astype(column.dtype))
    return file


def _far(column: np.ndarray) -> np.ndarray:
    column[-1] = 10**9
    return column


def _negative(column: np.ndarray) -> np.ndarray:
    column[0] = -512
    return column


@pytest.mark.parametrize(
    ("name", "change", "said"),
    [
        ("slide_id", lambda c: c[::-1], "not sorted"),
        ("slide_id", lambda c: np.sort(np.where(c == 1, 0, c)), "tiles of slide"),
        ("l0_x", _far, "outside its slide"),
        ("l0_y", _negative, "outside its slide"),
        ("level", lambda c: c + 1, "not the slide's read level"),
        ("level", lambda c: c + 40, "not the slide's read level"),
        ("read_size", lambda c: c * 4096, "not the slide's window size"),
    ],
)
def test_columns_that_lie_are_refused_naming_the_file(
    built: Path,
    name: str,
    change: Callable[[np.ndarray], np.ndarray],
    said: str,
) -> None:
    file = _rewrite_column(built, name, change)
    with pytest.raises(IndexFormatError) as caught:
        SlideIndex.open(built)
    assert str(file) in str(caught.value) and said in str(caught.value)
    assert "rebuild" in str(caught.value)


def _rewrite_json(index: Path, name: str, change: Callable[[object], None]) -> Path:
    file = _generation(index) / name
    document = json.loads(file.read_text())
    change(document)
    file.write_text(json.dumps(document))
    return file


@pytest.mark.parametrize("tile_size", ["big", 0, -3, 10**9, 2.5, True, None])
def test_a_tile_size_that_is_not_one_is_refused(built: Path, tile_size: object) -> None:
    """'big' or 0 was a raw ValueError (or a division by zero) far from its cause."""
    file = _rewrite_json(built, "meta.json", lambda m: m["params"].update(tile_size=tile_size))
    with pytest.raises(IndexFormatError) as caught:
        SlideIndex.open(built)
    assert str(file) in str(caught.value) and "tile_size" in str(caught.value)


def test_a_slide_table_that_lies_with_its_columns_is_refused(built: Path) -> None:
    """A window larger than the slide, in slides.json and the column alike: reading it would
    allocate read_size^2 pixels (2.7 TiB for one such tile)."""

    def huge(slides: object) -> None:
        assert isinstance(slides, list)
        slides[0]["read_size"] = 10**6

    file = _rewrite_json(built, "slides.json", huge)
    sizes = json.loads(file.read_text())
    first = sizes[0]
    _rewrite_column(
        built,
        "read_size",
        lambda c: np.where(np.arange(len(c)) < first["tiles"], 10**6, c),
    )
    with pytest.raises(IndexFormatError) as caught:
        SlideIndex.open(built)
    assert str(file) in str(caught.value) and "larger than the slide" in str(caught.value)
    level = _rewrite_json(built, "slides.json", lambda s: s[0].update(read_level=7, read_size=256))
    _rewrite_column(built, "read_size", lambda c: np.full_like(c, 256))
    _rewrite_column(built, "level", lambda c: np.where(np.arange(len(c)) < first["tiles"], 7, c))
    with pytest.raises(IndexFormatError, match="read level 7 of a slide with") as caught:
        SlideIndex.open(built)
    assert str(level) in str(caught.value)


def test_an_honest_index_opens_and_reads(built: Path) -> None:
    index = SlideIndex.open(built)
    batch = TileDataset(index).read_batch([0, len(index) - 1])
    assert batch.images.shape[0] == 2
