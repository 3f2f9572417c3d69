"""Whole-slide passes read each slide in strips, in one run per worker, so that each storage
tile is decoded once (`wsi_loader.dataset._scan`)."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import SlideFactory
from wsi_loader.dataset._loader import make_loader
from wsi_loader.dataset._scan import scan_order, slide_batches, strip_windows
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.slides import _tiff

_decoder = _tiff.TiffReader._decoder  # as imported: never a patched one


def _counted(self: _tiff.TiffReader, level: int, index: int, scale: int) -> Any:
    """`TiffReader._decoder` that logs each decode (in this process and forked workers)."""
    decode = _decoder(self, level, index, scale)

    def run() -> Any:
        with open(os.environ["DECODE_LOG"], "a") as fh:
            fh.write(f"{level} {index} {scale}\n")
        return decode()

    return run


@pytest.fixture
def wide(tmp_path: Path, make_slide: SlideFactory) -> SlideIndex:
    """A slide wider than the 8 MiB cache of decoded tiles the tests give readers: two rows
    of its 256 px storage tiles hold 12 MiB. A 224 px grid over them."""
    folder = tmp_path / "wide"
    folder.mkdir()
    (folder / "wide.svs").symlink_to(make_slide(width=8192, height=1024, seed=5))
    return build_index([folder], tmp_path / "idx", tile_size=224, level=0, min_tissue=0.0)


def test_batches_hold_every_row_once_one_slide_each_whatever_the_workers(
    index: SlideIndex,
) -> None:
    starts = index.slide_starts()
    seen = None
    for workers in (0, 1, 2, 3):
        batches = slide_batches(index, [0, 1], 16, workers)
        assert sorted(r for b in batches for r in b) == list(range(len(index)))
        for batch in batches:
            assert len({int(np.searchsorted(starts, r, side="right")) for r in batch}) == 1
        # the batches themselves do not depend on the workers: only the order they go out in
        kept = sorted(tuple(b) for b in batches)
        assert seen is None or kept == seen
        seen = kept
    # worker w (batch k goes to worker k % 2) reads one contiguous run of each slide's batches
    batches = slide_batches(index, [0], 16, 2)
    mine = [batches[k] for k in range(0, len(batches), 2)]
    order = scan_order(index, 0).tolist()
    positions = [order.index(b[0]) for b in mine]
    assert positions == sorted(positions) and positions[0] == 0


def test_strips_go_top_to_bottom(wide: SlideIndex) -> None:
    order = scan_order(wide, 0, cache_bytes=4 * 2**20)
    across = strip_windows(224, 4 * 2**20) * 224
    x = wide.columns["l0_x"][order]
    y = wide.columns["l0_y"][order]
    strip = x // across
    assert (np.diff(strip) >= 0).all() and len(np.unique(strip)) > 1
    for s in np.unique(strip):
        assert (np.diff(y[strip == s]) >= 0).all()


def read_all(
    index: SlideIndex, log: Path, workers: int, scan: bool, cache_mb: int = 8
) -> collections.Counter[str]:
    log.write_text("")
    options = {"num_workers": workers, "persistent_workers": False, "openslide_cache_mb": cache_mb}
    if scan:
        batches = slide_batches(index, [0], 32, workers, cache_bytes=cache_mb * 2**20 // 2)
        loader = make_loader(index, 32, batches=batches, **options)
    else:
        loader = make_loader(index, 32, sampler=range(len(index)), **options)
    assert sum(len(b.rows) for b in loader) == len(index)
    return collections.Counter(log.read_text().splitlines())


@pytest.mark.parametrize("workers", [0, 2])
def test_each_storage_tile_is_decoded_once_in_a_whole_slide_pass(
    wide: SlideIndex,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    workers: int,
) -> None:
    log = tmp_path / "decodes.log"
    monkeypatch.setenv("DECODE_LOG", str(log))
    monkeypatch.setattr(_tiff.TiffReader, "_decoder", _counted)  # forked workers too
    in_index_order = read_all(wide, log, workers, scan=False)
    scanned = read_all(wide, log, workers, scan=True)
    assert set(scanned) == set(in_index_order)  # the same storage tiles
    tiles = len(scanned)
    # index order: each window row evicts the storage row the next one shares, and workers
    # split neighbouring batches; strips: a tile is decoded again only where strips or the
    # workers' runs meet
    assert sum(in_index_order.values()) > 1.5 * tiles
    assert sum(scanned.values()) < 1.25 * tiles
