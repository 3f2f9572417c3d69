from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SlideFactory
from wsi_loader.index import SlideIndex, build_index

# level-0 storage tiles (column, row) broken in the "bad" slide: a 2x2 block in its tissue
CORRUPT = [(c, r) for c in range(3, 5) for r in range(3, 5)]


@pytest.fixture
def archive(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(make_slide(width=2560, height=2048, seed=31), folder / "good.svs")
    shutil.copy(make_slide(width=2048, height=2048, seed=32, corrupt=CORRUPT), folder / "bad.svs")
    (folder / "labels.csv").write_text("slide,label\ngood,normal\nbad,tumour\n")
    return folder


@pytest.fixture
def index(archive: Path, tmp_path: Path) -> SlideIndex:
    return build_index(
        [archive],
        tmp_path / "idx",
        tile_size=256,
        level=0,
        min_tissue=0.0,
        labels=str(archive / "labels.csv"),
    )


def corrupt_rows(index: SlideIndex) -> np.ndarray:
    """Rows whose window is exactly one of the corrupt storage tiles."""
    cols = index.columns
    bad_id = next(i for i, s in enumerate(index.slides) if s.path.endswith("bad.svs"))
    hits = np.zeros(len(index), dtype=bool)
    for c, r in CORRUPT:
        hits |= (cols["slide_id"] == bad_id) & (cols["l0_x"] == c * 256) & (cols["l0_y"] == r * 256)
    return np.flatnonzero(hits)
