"""Slide faults found before reading: missing slides, and slides changed since indexing."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_loader import SlideIndex, TileDataset, build_index
from wsi_loader.errors import SlideChangedError, SlideNotFoundError


def _build(archive: Path, out: Path) -> SlideIndex:
    return build_index([archive], out, tile_size=256, level=0, min_tissue=0.0, root=str(archive))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_truncated_slide_is_said_changed_and_to_rebuild(archive: Path, tmp_path: Path) -> None:
    """It was a SlideNotFoundError advising a root for a moved archive: the slide is there,
    it is another file than the one indexed."""
    _build(archive, tmp_path / "idx")
    _truncate(archive / "good.svs")
    with pytest.raises(SlideChangedError) as caught:
        TileDataset(tmp_path / "idx")
    message = str(caught.value)
    assert "good.svs changed since indexing" in message and "rebuild the index" in message
    assert "moved" not in message and "--root" not in message
    assert not isinstance(caught.value, FileNotFoundError)


def test_missing_and_changed_slides_each_get_their_advice(archive: Path, tmp_path: Path) -> None:
    _build(archive, tmp_path / "idx")
    _truncate(archive / "good.svs")
    (archive / "bad.svs").unlink()
    with pytest.raises(SlideNotFoundError) as caught:
        TileDataset(tmp_path / "idx")
    message = str(caught.value)
    assert "bad.svs does not exist" in message and "good.svs changed since indexing" in message
    assert "if the archive moved" in message and "rebuild the index" in message


def test_a_moved_archive_of_an_index_of_absolute_paths_is_told_to_rebuild(
    archive: Path, tmp_path: Path
) -> None:
    """The advice was to give the archive's new folder as the root, which such an index
    cannot take (refused: it stores absolute paths)."""
    build_index([archive], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0)
    archive.rename(tmp_path / "elsewhere")
    with pytest.raises(SlideNotFoundError) as caught:
        TileDataset(tmp_path / "idx")
    message = str(caught.value)
    assert "stores absolute slide paths" in message and "--root" in message
    assert "give its folder as the root" not in message
    assert "rebuild the index where the slides are now" in message
