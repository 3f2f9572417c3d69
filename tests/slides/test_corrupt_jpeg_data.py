"""Corrupt entropy-coded JPEG data is a failed read on every decode path: libjpeg reports it
only as a warning ("Corrupt JPEG data: ..."), which a decoder that ignores warnings turns into
garbled pixels served as good.

Every tile OpenSlide fails fails here too. A few more fail here: libjpeg's "N extraneous bytes
before marker 0xd9" comes at the end of the scan, which OpenSlide never reads, so OpenSlide
serves those tiles garbled; the tests check that each such tile really is garbled (its
OpenSlide pixels differ from the intact file's), so no good tile is ever failed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import openslide
import pytest
import tifffile

from tests.conftest import SlideFactory
from wsi_loader import TileDataset, build_index, make_loader
from wsi_loader.errors import TileReadError
from wsi_loader.slides._tiff import TiffReader


def flip_entropy_bytes(path: Path, tiles: list[int], seed: int = 0) -> None:
    """XOR a few bytes in the middle of the entropy-coded data of level-0 tiles."""
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        offsets, counts = list(page.dataoffsets), list(page.databytecounts)
    rng = np.random.default_rng(seed)
    with open(path, "r+b") as fh:
        for tile in tiles:
            start, count = offsets[tile], counts[tile]
            for at in rng.integers(count // 3, count - 16, size=3).tolist():
                fh.seek(start + at)
                byte = fh.read(1)[0]
                fh.seek(start + at)
                fh.write(bytes([byte ^ 0x5A if byte ^ 0x5A != 0xFF else byte ^ 0x33]))


def check_against_openslide(
    path: Path, clean: Path, tiles: list[int], size: tuple[int, int]
) -> set[int]:
    """Read ``tiles`` with OpenSlide (a fresh handle each: errors latch) and with ours; check
    that ours fails every tile OpenSlide fails, that every further tile ours fails is one
    OpenSlide serves garbled, and that the tiles ours reads equal OpenSlide's pixels. Returns
    the tiles ours failed."""
    tw, th = size
    with tifffile.TiffFile(path) as tif:
        across = -(-tif.pages[0].imagewidth // tw)
    ours, theirs, garbled = set(), set(), set()
    reader = TiffReader(str(path))
    with openslide.OpenSlide(str(clean)) as intact:
        for tile in tiles:
            x, y = (tile % across) * tw, (tile // across) * th
            mine = None
            try:
                mine = reader.read_region(x, y, 0, tw, th)
            except TileReadError:
                ours.add(tile)
            with openslide.OpenSlide(str(path)) as slide:
                try:
                    pixels = np.asarray(slide.read_region((x, y), 0, (tw, th)))
                except openslide.OpenSlideError:
                    theirs.add(tile)
                    continue
            if not np.array_equal(pixels, np.asarray(intact.read_region((x, y), 0, (tw, th)))):
                garbled.add(tile)
            if mine is not None:
                np.testing.assert_array_equal(mine, pixels[..., :3])
    reader.close()
    assert theirs, "the corruption must be one OpenSlide notices"
    assert theirs <= ours
    assert ours - theirs <= garbled
    return ours


@pytest.mark.parametrize("seed", [0, 1])
def test_synthetic_svs_fails_where_openslide_fails(
    make_slide: SlideFactory, tmp_path: Path, seed: int
) -> None:
    path = tmp_path / "flipped.svs"
    clean = make_slide(width=2048, height=2048, seed=61)
    shutil.copy(clean, path)
    tiles = list(range(5, 64, 4))
    flip_entropy_bytes(path, tiles, seed)
    check_against_openslide(path, clean, tiles, (256, 256))


def test_real_aperio_scan_fails_where_openslide_fails(testdata: Path, tmp_path: Path) -> None:
    path = tmp_path / "CMU-1 flipped.svs"
    shutil.copy(testdata / "CMU-1-Small-Region.svs", path)
    tiles = list(range(10, 120, 7))
    flip_entropy_bytes(path, tiles, 3)
    check_against_openslide(path, testdata / "CMU-1-Small-Region.svs", tiles, (240, 240))


@pytest.mark.parametrize("decode", ["cpu", "device"])
def test_corrupt_tiles_are_not_ok_and_quarantined(
    make_slide: SlideFactory, tmp_path: Path, decode: str
) -> None:
    from wsi_loader.device._loader import DeviceLoader

    folder = tmp_path / "slides"
    folder.mkdir()
    path = folder / "flipped.svs"
    clean = make_slide(width=2048, height=2048, seed=61)
    shutil.copy(clean, path)
    tiles = list(range(5, 64, 4))
    flip_entropy_bytes(path, tiles, 0)
    failed = check_against_openslide(path, clean, tiles, (256, 256))
    index = build_index([folder], tmp_path / "idx", level=0, min_tissue=0.0, tile_size=256)
    loader = make_loader(index, batch_size=16, num_workers=0, shuffle=False, decode=decode)
    bad_rows = set()
    for batch in DeviceLoader(loader, "cpu"):
        bad_rows |= {int(r) for r, ok in zip(batch["row"], batch["ok"], strict=True) if not ok}
    cols = index.columns
    expected = {
        int(r)
        for r in range(len(index))
        if (int(cols["l0_y"][r]) // 256) * 8 + int(cols["l0_x"][r]) // 256 in failed
    }
    assert bad_rows == expected
    assert len(index.quarantine.read()) == len(expected)
    # and a plain dataset read says why
    ds = TileDataset(index, on_error="raise")
    with pytest.raises(TileReadError, match=r"Corrupt JPEG data|JPEG"):
        ds.read_batch(sorted(expected)[:1])


def test_device_decoding_applies_the_chosen_policy(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    from wsi_loader import ConfigError
    from wsi_loader.device._loader import DeviceLoader

    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(make_slide(width=2048, height=2048, seed=61), folder / "flipped.svs")
    flip_entropy_bytes(folder / "flipped.svs", list(range(5, 64, 4)), 0)
    index = build_index([folder], tmp_path / "idx", level=0, min_tissue=0.0, tile_size=256)
    with pytest.raises(ConfigError, match="decode='device'"):
        make_loader(index, decode="device", on_error="substitute")
    loader = make_loader(
        index, batch_size=64, num_workers=0, shuffle=False, decode="device", on_error="raise"
    )
    with pytest.raises(TileReadError, match="Corrupt JPEG data"):
        list(DeviceLoader(loader, "cpu"))
    assert {r["policy"] for r in index.quarantine.read()} == {"raise"}
