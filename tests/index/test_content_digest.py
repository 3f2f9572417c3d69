"""A slide's content digest covers its TIFF directory (every tile's offset and byte count):
a tile re-encoded in the middle of the file, or an offset array changed beyond the first
64 KiB, is another slide, for the index's rebuild as for its readers; a touched or copied
slide is the same one; a non-TIFF file keeps the size-and-ends digest; an index recorded
with that older digest is not all slides changed."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from tests.index.slide_rewrites import rewrite_keeping_mtime
from wsi_loader.dataset import TileDataset
from wsi_loader.index import _fingerprints, build_index
from wsi_loader.index._fingerprints import TIFF_KIND, content_key, ends_digest, fingerprint
from wsi_loader.index._tiff_directory import directory_bytes

OPTIONS = {"tile_size": 256, "level": 0, "min_tissue": 0.0}


@pytest.fixture
def big(make_slide: SlideFactory) -> Path:
    """A slide with a level whose tile arrays and tiles lie beyond the first and last 64 KiB."""
    return make_slide(width=4096, height=4096, seed=71)


@pytest.mark.parametrize("rewrite", ["reencode", "swap"])
def test_a_tile_rewritten_in_the_middle_is_another_content(
    big: Path, tmp_path: Path, rewrite: str
) -> None:
    slide = tmp_path / "a.svs"
    shutil.copyfile(big, slide)
    before, legacy = content_key(str(slide)), content_key(str(slide), like="0" * 32)
    print_before = fingerprint(str(slide))
    rewrite_keeping_mtime(slide, rewrite)
    # size, head, tail and mtime are those of before: the fingerprint and the older digest
    # cannot tell; the directory can
    assert fingerprint(str(slide)) == print_before
    assert content_key(str(slide), like="0" * 32) == legacy
    assert before.startswith(TIFF_KIND)
    assert content_key(str(slide)) != before
    assert ends_digest(content_key(str(slide))) == legacy  # what local and remote copies share


def test_a_touched_or_copied_slide_is_the_same_content(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    slide = make_slide(width=2048, height=1536, seed=72)
    key = content_key(str(slide))
    copy = tmp_path / "copy.svs"
    shutil.copyfile(slide, copy)  # cp --preserve=none: a new inode and mtime
    os.utime(copy, ns=(10**18, 10**18))
    assert content_key(str(copy)) == key
    other = make_slide(width=2048, height=1536, seed=73)
    assert content_key(str(other)) != key


def test_a_file_that_is_no_tiff_keeps_the_size_and_ends_digest(tmp_path: Path) -> None:
    """DICOM folders, MRXS, any other format: size and first and last 64 KiB, as before."""
    path = tmp_path / "slide.bin"
    path.write_bytes(b"DICM" + bytes(range(256)) * 1000)
    assert directory_bytes(str(path), path.stat().st_size) is None
    key = content_key(str(path))
    assert not key.startswith(TIFF_KIND) and len(key) == 32
    size = path.stat().st_size
    raw = path.read_bytes()
    assert key == _fingerprints.content_digest(size, raw[:65536] + raw[-65536:])


def test_a_damaged_directory_still_digests_to_the_same_value(tmp_path: Path) -> None:
    """A TIFF whose first IFD points past its end (or loops) is digested, never raises."""
    path = tmp_path / "bad.tif"
    path.write_bytes(b"II*\0" + (10**6).to_bytes(4, "little") + bytes(100))
    assert content_key(str(path)) == content_key(str(path))
    loop = tmp_path / "loop.tif"
    ifd = (0).to_bytes(2, "little") + (8).to_bytes(4, "little")  # no entries, next: itself
    loop.write_bytes(b"II*\0" + (8).to_bytes(4, "little") + ifd)
    assert content_key(str(loop)).startswith(TIFF_KIND)


@pytest.mark.parametrize("rewrite", ["reencode", "swap"])
def test_a_rebuild_indexes_again_a_slide_rewritten_in_the_middle(
    big: Path, make_slide: SlideFactory, tmp_path: Path, rewrite: str
) -> None:
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copyfile(big, folder / "a.svs")
    shutil.copyfile(make_slide(width=1024, height=1024, seed=74), folder / "b.svs")
    first = build_index([folder], tmp_path / "idx", **OPTIONS)
    rewrite_keeping_mtime(folder / "a.svs", rewrite)
    again = build_index([folder], tmp_path / "idx", **OPTIONS)
    assert again.meta["build"] == {"unchanged": 1, "indexed": 1}
    assert again.slides[0].content != first.slides[0].content
    assert again.slides[1].content == first.slides[1].content


def test_an_index_with_the_older_digest_is_read_and_rebuilt_without_redoing_slides(
    make_slide: SlideFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Indexes recorded size-and-ends digests before: their slides still read (the digest is
    compared with one of its kind), and the next rebuild carries them over, recording the
    current digest, with one line that says so."""
    folder = tmp_path / "slides"
    folder.mkdir()
    for seed in (75, 76):
        shutil.copyfile(make_slide(width=1024, height=1024, seed=seed), folder / f"{seed}.svs")
    with monkeypatch.context() as patched:  # the digest of before: no directory
        patched.setattr(_fingerprints, "directory_bytes", lambda path, size: None)
        old = build_index([folder], tmp_path / "idx", **OPTIONS)
    assert all(not s.content.startswith(TIFF_KIND) for s in old.slides if s.content)
    assert TileDataset(old, on_error="raise", record_failures=False)[0] is not None
    with caplog.at_level(logging.INFO, logger="wsi_loader.index._builder"):
        new = build_index([folder], tmp_path / "idx", **OPTIONS)
    assert new.meta["build"] == {"unchanged": 2, "indexed": 0}
    assert all(s.content and s.content.startswith(TIFF_KIND) for s in new.slides)
    assert "2 unchanged slides had a content digest of an older kind" in caplog.text
    assert TileDataset(new, on_error="raise", record_failures=False)[0] is not None


@pytest.mark.parametrize(
    "name",
    [
        "CMU-1-Small-Region.svs",
        "tcga-cr-7395-01a-01-ts1.svs",
        "test3-DAPI-2-(387).ndpi",
        "small_vectra.qptiff",
        "kidney-48-5.tif",
    ],
)
def test_real_tiff_slides_are_digested_with_their_directory_and_copies_match(
    testdata: Path, tmp_path: Path, name: str
) -> None:
    slide = testdata / name
    key = content_key(str(slide))
    assert key.startswith(TIFF_KIND)
    directory = directory_bytes(str(slide), slide.stat().st_size)
    assert directory is not None and len(directory) > 100
    copy = tmp_path / name
    shutil.copyfile(slide, copy)  # a new inode and mtime, the same bytes
    assert content_key(str(copy)) == key


def test_a_real_dicom_slide_keeps_the_size_and_ends_digest(testdata: Path) -> None:
    """DICOM (and any file that is no TIFF) is digested by size, head and tail, as before."""
    path = testdata / "dicom-boxes" / "boxes_0.dcm"
    raw = path.read_bytes()
    expected = _fingerprints.content_digest(
        len(raw), raw[:65536] + raw[max(65536, len(raw) - 65536) :]
    )
    assert content_key(str(path)) == expected
